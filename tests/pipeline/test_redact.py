"""redact_url / redact_text: what packshard writes or prints carries no credentials."""

from __future__ import annotations

import logging
import re
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packshard.packers.urls import RedactingFilter, _strip_user_info, redact_text, redact_url


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://user:PASSWORD@host/x.jsonl?sig=SECRET", "http://host/x.jsonl"),
        ("https://h:8080/a/b.parquet?X-Amz-Signature=SECRET#frag", "https://h:8080/a/b.parquet"),
        ("HTTPS://u:SECRET@h/x", "HTTPS://h/x"),
        ("http://SECRET@host", "http://host"),
        ("s3://AKIA:SECRET@bucket/a.jsonl?versionId=3", "s3://bucket/a.jsonl"),
        ("ftp://u:SECRET@h/data/x.jsonl", "ftp://h/data/x.jsonl"),
        ("s3://bucket/x.jsonl?token=SE/CRET", "s3://bucket/x.jsonl"),  # a "/" in the value
        ("s3://bucket/part-?.jsonl?X-Amz-Signature=SECRET", "s3://bucket/part-?.jsonl"),
        # AWS secret keys hold "/" (unencoded in a URL: the authority is not cut there)
        ("s3://AKIA:SE/CR+ET@bucket/a.jsonl", "s3://bucket/a.jsonl"),
        ("gs://u:SE/CRET@bkt/o", "gs://bkt/o"),
        # fsspec's chained URLs: each part
        ("zip://ds::http://alice:SECRET@h/ds.zip", "zip://ds::http://h/ds.zip"),
        ("simplecache::s3://AKIA:SECRET@b/x.jsonl", "simplecache::s3://b/x.jsonl"),
        ("tar://a::zip://b::https://h/c.zip?sig=SECRET", "tar://a::zip://b::https://h/c.zip"),
        ("http://[::1]:8080/x.jsonl?sig=SECRET", "http://[::1]:8080/x.jsonl"),  # no chain
    ],
)
def test_redact_url_strips_user_info_and_query(url: str, expected: str) -> None:
    assert redact_url(url) == expected
    assert "SECRET" not in redact_url(url)


@pytest.mark.parametrize(
    "url",
    [
        "/tmp/data/a?b.jsonl",  # a local path (a glob) is unchanged
        "relative/x@y.jsonl",
        "demo://?seed=3&num_math=10",  # the generator's parameters, not a secret
        "s3://bucket/part-?.jsonl",  # a glob character outside any key=value query
        "s3://bucket/logs/day=0?/lang=en/*.jsonl",  # a Hive-style glob: no key= after the ?
        "s3://bucket/raw/",
        "hf://datasets/org/name@main/train.jsonl",  # a revision, not user info
        "abfs://container@account.dfs.core.windows.net/x.parquet",  # the container, kept
        "s3://bucket/a:b@c/x.jsonl",  # a key with ":" and "@" in it
        "http://host:8080/users/@me/x.jsonl",  # a port, then a path with "@"
        "hdfs://namenode:8020/user/alice@CORP/x.jsonl",
        "s3://arn:aws:s3:us-east-1:123456789012:accesspoint/ap/runs/alice@corp/x.jsonl",
    ],
)
def test_redact_url_keeps_what_is_no_secret(url: str) -> None:
    assert redact_url(url) == url


def test_redact_text_redacts_every_url_in_a_message() -> None:
    msg = (
        "input 'http://u:SECRET@h/x.jsonl?sig=SECRET' line 3: bad JSON; "
        "also tried https://h2/y?token=SECRET, and /local/path?x"
    )
    out = redact_text(msg)
    assert "SECRET" not in out
    assert out == (
        "input 'http://h/x.jsonl' line 3: bad JSON; also tried https://h2/y, and /local/path?x"
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # "'" is legal in user info and queries: repr then quotes the URL with '"'
        (
            """input "http://alice:pa'SECRET@h/missing.jsonl" does not exist""",
            'input "http://h/missing.jsonl" does not exist',
        ),
        (
            "reading http://alice:pa'SECRET@h:80/q9.jsonl failed: 503",
            "reading http://h:80/q9.jsonl failed: 503",
        ),
        # aiohttp quotes its URL in "'" whatever it holds
        (
            "ClientResponseError: 503, url='http://h/x.jsonl?sig=a'SECRET')",
            "ClientResponseError: 503, url='http://h/x.jsonl')",
        ),
        (
            "tried ['http://h/a.jsonl', 'http://u:SECRET@h/b.jsonl?sig=SECRET']",
            "tried ['http://h/a.jsonl', 'http://h/b.jsonl']",
        ),
        (
            "dataset zip://ds::http://alice:SECRET@h/ds.zip (2 shards)",
            "dataset zip://ds::http://h/ds.zip (2 shards)",
        ),
        ("see http://h/x.jsonl?sig=SECRET.", "see http://h/x.jsonl."),
        # '"' in a URL: repr quotes it with "'"
        (repr('http://alice:pa"SECRET@h/x.jsonl'), "'http://h/x.jsonl'"),
        ("""url='https://h/x?a="b"&sig=SECRET'""", "url='https://h/x'"),
        (repr("http://alice:pa'X\"SECRET@h/x"), "'http://h/x'"),
        # a "::" in a query is no chain
        ("https://h/x.jsonl?X-Token=reader::SECRET", "https://h/x.jsonl"),
        ("got https://h/x?sig=AAA::SECRET::CCC", "got https://h/x"),
        # after a digit, ".", "-" or "+"
        ("step 3/5...http://u:SECRET@h/x", "step 3/5...http://h/x"),
        ("2.https://h/x?sig=SECRET -https://h/y?sig=SECRET", "2.https://h/x -https://h/y"),
        # URLs glued to one another
        ("--input http://h/a,http://u:SECRET@h/b", "--input http://h/a,http://h/b"),
        ("[http://h/a](http://u:SECRET@h/a)", "[http://h/a](http://h/a)"),
        ("'http://h/a'+'http://u:SECRET@h/b'", "'http://h/a'+'http://h/b'"),
    ],
)
def test_redact_text_finds_where_a_url_ends(text: str, expected: str) -> None:
    assert redact_text(text) == expected


# the rule `_strip_user_info` follows, as a regular expression (quadratic: 10x the text, 100x
# the time, minutes for a 1 MB log line of "=a:b=a:b...")
_USER_INFO_RE = re.compile(
    r"(?<![^\s'\"(\[=])(?!arn:)[^\s'\"()\[\]/:@=]+:[^\s'\"/][^\s'\"]*@(?=[A-Za-z0-9\[])"
)


@settings(max_examples=3000, deadline=None)
@given(st.text(alphabet="ab:@/=([)] '\"n1", max_size=16).map(lambda t: t.replace("n", "arn:")))
def test_user_info_outside_urls_follows_its_rule(text: str) -> None:
    assert _strip_user_info(text) == _USER_INFO_RE.sub("", text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # gcsfs quotes gs://alice:PW@bucket/x's "bucket name" without the scheme
        ("bucket name alice:SECRET@bucket: no credentials", "bucket name bucket: no credentials"),
        ("bucket 'alice:p@ss@bucket'", "bucket 'bucket'"),
        ("(u:SECRET@host)", "(host)"),
        ("key=u:SECRET@host", "key=host"),
        ('Invalid bucket name "AKIA:SE/CRET@bucket"', 'Invalid bucket name "bucket"'),
    ],
)
def test_redact_text_removes_user_info_outside_a_url(text: str, expected: str) -> None:
    assert redact_text(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "git@github.com:org/repo",
        "at 10:30 today",
        "mail user@host.com",
        "s3://b/k:v@x/y",
        # S3's AccessDenied names the principal and resource a user needs to fix it
        "User: arn:aws:sts::123456789012:assumed-role/Role/alice@example.com is not authorized",
    ],
)
def test_redact_text_keeps_what_is_no_user_info(text: str) -> None:
    assert redact_text(text) == text


def test_the_cli_filter_drops_library_tracebacks_only() -> None:
    """A storage library's record keeps its (redacted) line and loses its traceback; a
    packshard record keeps both; the library's filter keeps everything but the secret."""

    def record(name: str) -> logging.LogRecord:
        try:
            raise ValueError("boom")
        except ValueError:
            info = sys.exc_info()
        return logging.LogRecord(name, logging.WARNING, __file__, 1, "bucket %s", ("u:PW@b",), info)

    gcsfs_record, own = record("gcsfs"), record("packshard.pipeline.inputs")
    cli = RedactingFilter(library_tracebacks=False)
    assert cli.filter(gcsfs_record) and cli.filter(own)
    assert gcsfs_record.getMessage() == "bucket b" and gcsfs_record.exc_info is None
    assert own.getMessage() == "bucket b" and own.exc_info is not None
    kept = record("gcsfs")
    assert RedactingFilter().filter(kept) and kept.exc_info is not None
    assert kept.getMessage() == "bucket b"


def test_object_store_urls_with_credentials_are_refused_redacted() -> None:
    """s3fs / pyarrow read ``s3://key:secret@bucket`` as a bucket named ``key:secret@bucket``
    (botocore's error then quotes the secret): such a URL is refused at once, redacted;
    http(s) user info is basic auth and stays."""
    from packshard.packers.urls import UrlError, credentials_in, dataset_url

    for url in ("s3://AKIA:SE/CRET@bucket/ds", "gs://u:SECRET@bkt/ds", "s3a://k:SECRET@b/x"):
        assert credentials_in(url)
        with pytest.raises(UrlError) as e:
            dataset_url(url)
        assert "SECRET" not in str(e.value) and "credentials in the URL are not read" in str(
            e.value
        )
    for url in (
        "http://u:SECRET@host/ds",
        "s3://bucket/a:b@c",
        "abfs://c@acct/x",
        "/tmp/a:b@c",
        "s3://arn:aws:s3:us-east-1:123456789012:accesspoint/ap/alice@corp/x",
    ):
        assert not credentials_in(url)
