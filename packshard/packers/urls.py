"""URLs as packshard writes or prints them: without credentials or signatures.

A URL may carry user info (``http://user:pw@host/x``) or a signed query
(``https://host/x?X-Amz-Signature=...``). The code that reads keeps the URL as given; whatever
is written (manifest, index, stats) or printed (logs, errors, progress) goes through
`redact_url` / `redact_text`. Used by the pack job (`pipeline.inputs`) and by every reader of a
dataset (`ShardDataset.url` is the redacted URL; its filesystem and root keep the real one).
"""

from __future__ import annotations

import logging
import os
import re

DEMO_SCHEME = "demo://"  # the pack job's built-in generated dataset (pipeline.demo)
_QUERY_SCHEMES = frozenset({"http", "https"})  # "?" starts a query; elsewhere it may be a glob
_CONTAINER_AT_SCHEMES = frozenset({"abfs", "abfss", "az", "adl"})  # container@account
# a query tail starts with ``key=`` (``s3://b/day=0?/lang=en/*.jsonl`` is a Hive-style glob)
_QUERY = re.compile(r"[A-Za-z0-9_.~-]+=.*", re.DOTALL)
# where a URL starts in prose (`redact_text` finds where it ends)
_SCHEME_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
# after a URL in prose: trailing punctuation belongs to the sentence
_SENTENCE_PUNCTUATION = "'.,;:)]}"
# before another URL glued to one (``a,b``, ``[a](b)``, ``'a'+'b'``): where the first ends
_GLUE = ",;|(['\""
# fsspec's chained URLs (``zip://member::http://host/a.zip``, ``simplecache::s3://b/x``): a
# "::" before a protocol name (an IPv6 host's "[::1]" is none)
_CHAIN = re.compile(r"::(?=[A-Za-z][A-Za-z0-9+.-]*(?:://|::|$))")
# user info outside a URL: ``name:secret@`` right before a host or bucket name (an AWS
# secret may hold "/"), in a word (text between whitespace and quotes), starting it or after
# one of "([=": see `_strip_user_info`
_WORDS = re.compile(r"([\s'\"]+)")
_USER_STOP = frozenset("()[]/:@=")
_USER_AFTER = re.compile(r"[(\[=]")
_HOST_AT = re.compile(r"@(?=[A-Za-z0-9\[])")
# ``name:secret@`` at the start of a URL's authority, the secret holding "/" unencoded
_LEADING_USER_INFO = re.compile(r"(?!arn:)[^/:@]+:[^@]*@")  # not an access point ARN


# object stores addressed as scheme://bucket/key: bucket names hold no user info (and no ":"),
# and their fsspec clients create a missing bucket on the first write
BUCKET_SCHEMES = frozenset({"s3", "s3a", "s3n", "gs", "gcs"})


class UrlError(ValueError):
    """A URL packshard refuses before using it (one line, secrets removed)."""


def credentials_in(url: str) -> bool:
    """Whether an object-store URL (``s3://key:secret@bucket/x``) carries user info: its
    clients read it as part of the bucket name (an http(s) URL's user info is basic auth)."""
    scheme, _, rest = url.partition("://")
    return scheme.lower() in BUCKET_SCHEMES and _LEADING_USER_INFO.match(rest) is not None


def refuse_credentials(url: str) -> None:
    """UrlError for an object-store URL with user info (`credentials_in`), naming it redacted."""
    if credentials_in(url):
        scheme = url.partition("://")[0]
        raise UrlError(
            f"{redact_url(url)}: credentials in the URL are not read by the {scheme}:// client (it would "
            "take them for the bucket's name): give them as storage options (--storage-option "
            "key=... --storage-option secret=...) or the store's environment variables"
        )


def dataset_url(url: object) -> str:
    """A dataset's URL or local path as a string (a ``pathlib.Path`` is fine); TypeError for
    anything else, ValueError for an empty one (which would read the working directory)."""
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if isinstance(url, bytes) or not isinstance(url, str):
        raise TypeError(
            f"a dataset URL must be a str or os.PathLike (a local path, s3://..., gs://...), "
            f"got {type(url).__name__}"
        )
    if not url.strip():
        raise ValueError("the dataset URL is empty: give the dataset's directory or URL")
    refuse_credentials(url)
    scheme, _, rest = url.partition("://")
    if scheme.lower() in _QUERY_SCHEMES and ("?" in rest or "#" in rest):
        raise UrlError(
            f"{redact_url(url)}: a dataset URL with a query string (?...) is not read: packshard "
            "reads manifest.json, index.arrow and the shards under the dataset's URL and sends no "
            "query with them. Serve the dataset without one, or give its store's own URL (s3://, "
            "gs://, az://) with credentials as storage options"
        )
    return url


def redact_url(url: str) -> str:
    """`url` without its secrets, for anything packshard writes or prints.

    User info (``user:password@``) and the query string (a signed URL's ``?X-Amz-Signature=...``,
    ``?sig=...``) are removed: ``http://u:PW@host/x.jsonl?sig=s`` becomes ``http://host/x.jsonl``.
    For ``http(s)://`` everything from ``?`` or ``#`` goes; for other schemes, where fsspec reads
    ``?`` as a glob character, only a tail that starts ``?key=`` does (``s3://b/part-?.jsonl``
    and ``s3://b/day=0?/lang=en/x.jsonl`` stay).
    Azure's ``abfs://container@account...`` keeps its container (it is no credential). Local
    paths and ``demo://`` URLs (whose query holds the generator's integer parameters) are
    returned unchanged.
    """
    if "://" not in url or url.startswith(DEMO_SCHEME):
        return url
    parts = _chain_parts(url)
    if len(parts) > 1:
        return "::".join(redact_url(p) for p in parts)
    scheme, _, rest = url.partition("://")
    if scheme.lower() in _QUERY_SCHEMES:
        rest = rest.split("#", 1)[0].split("?", 1)[0]
    elif "?" in rest and _QUERY.fullmatch(rest.rsplit("?", 1)[1]):
        rest = rest.rsplit("?", 1)[0]
    lowered = scheme.lower()
    if lowered in BUCKET_SCHEMES:  # bucket names hold no ":"; elsewhere a port may come first
        info = _LEADING_USER_INFO.match(rest)  # a secret may hold "/" (AWS secret keys do)
        if info is not None:
            rest = rest[info.end() :]
    authority, slash, path = rest.partition("/")
    if lowered not in _CONTAINER_AT_SCHEMES:
        authority = authority.rpartition("@")[2]
    return f"{scheme}://{authority}{slash}{path}"


def redact_text(text: str) -> str:
    """`text` (an error message, a log line) with every ``scheme://...`` URL in it redacted,
    and any ``user:password@`` left outside one removed (libraries quote a URL's parts:
    gcsfs logs ``bucket name alice:PW@bucket`` for ``gs://alice:PW@bucket/x``).

    A URL ends at whitespace, ``"``, ``<`` or ``>``. In quotes (``'...'``, as ``repr`` and
    libraries quote it) it ends at a closing quote: one followed by the text's end, whitespace
    or punctuation, so a ``'`` inside it (legal in user info and queries) does not cut it short;
    in prose, punctuation at its end belongs to the sentence."""
    out: list[str] = []
    pos = 0
    for m in _SCHEME_IN_TEXT.finditer(text):
        start = m.start()
        if start < pos:  # inside a URL already redacted (the next part of a chained URL)
            continue
        end = _url_end(text, start, text[start - 1] if start else "")
        out += [text[pos:start], redact_url(text[start:end])]
        pos = end
    out.append(text[pos:])
    return _strip_user_info("".join(out))


def _strip_user_info(text: str) -> str:
    """`text` without any ``name:secret@`` before a host (``bucket name alice:PW@bucket``).

    In each word (whitespace and quotes separate them), user info starts the word or follows
    "(", "[" or "="; its name holds none of ``()[]/:@=``, its secret does not start with "/",
    and it ends at the word's last "@" before a letter, digit or "[" (a secret may hold "@").
    An access point ARN (``arn:...``) is none. Linear in the text's length: a regular
    expression for this backtracks (quadratic on ``=a:b=a:b...``, minutes for a 1 MB line)."""
    if "@" not in text:
        return text
    return "".join(
        _strip_word(w) if i % 2 == 0 and "@" in w else w for i, w in enumerate(_WORDS.split(text))
    )


def _strip_word(word: str) -> str:
    at = -1
    for m in _HOST_AT.finditer(word):  # the last "@" before a host
        at = m.start()
    if at < 0:
        return word
    for start in (0, *(m.end() for m in _USER_AFTER.finditer(word, 0, at))):
        if word.startswith("arn:", start):
            continue
        colon = start
        while colon < at and word[colon] not in _USER_STOP:
            colon += 1
        if colon > start and word[colon] == ":" and colon + 1 < at and word[colon + 1] != "/":
            return word[:start] + word[at + 1 :]
    return word


def _chain_parts(url: str) -> list[str]:
    """The parts of a chained URL (`_CHAIN`), one part for any other; a "::" inside an
    http(s) part's query or fragment (``?token=a::b``) is the value's, not a chain's."""
    parts, start = [], 0
    for m in _CHAIN.finditer(url):
        part = url[start : m.start()]
        if part.lower().startswith(("http://", "https://")) and ("?" in part or "#" in part):
            continue
        parts.append(part)
        start = m.end()
    return [*parts, url[start:]]


def _url_end(text: str, start: int, opening: str) -> int:
    """Where the URL at `start` ends (see `redact_text`); `opening` is the character before it."""
    quote = opening if opening in ("'", '"') else ""
    end = start
    while end < len(text):
        c = text[end]
        if c.isspace() or c in "<>":
            break
        if c == '"' and quote != "'":  # a URL holding '"' is quoted with "'" (repr)
            break
        if c == "'" == quote:
            after = text[end + 1 : end + 2]
            if not after or after.isspace() or after in _SENTENCE_PUNCTUATION + '"+':
                break
        if c in _GLUE and end > start and _SCHEME_IN_TEXT.match(text, end + 1):
            break  # another URL starts: each is redacted on its own
        end += 1
    if quote:
        return end
    while end > start and text[end - 1] in _SENTENCE_PUNCTUATION:
        end -= 1
    return end


class RedactingFilter(logging.Filter):
    """Strips credentials from a log record (`redact_text`). With `library_tracebacks=False`
    (the CLIs), a record from a logger outside packshard also loses its traceback: a storage
    library logs one for each retry it gives up on (gcsfs: ~10 lines a request), while the
    error packshard reports names the cause in one line."""

    def __init__(self, *, library_tracebacks: bool = True) -> None:
        super().__init__()
        self.library_tracebacks = library_tracebacks

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = redact_text(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        if not self.library_tracebacks and not record.name.startswith("packshard"):
            record.exc_info = record.exc_text = record.stack_info = None
        return True


def add_redacting_filter(handler: logging.Handler, *, library_tracebacks: bool = True) -> None:
    """Give `handler` a `RedactingFilter`, unless it has one (a CLI's main may run twice in a
    process: tests, notebooks)."""
    if not any(isinstance(f, RedactingFilter) for f in handler.filters):
        handler.addFilter(RedactingFilter(library_tracebacks=library_tracebacks))
