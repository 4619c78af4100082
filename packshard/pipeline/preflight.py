"""The pack job's checks before Ray starts: the output, the inputs and their columns, the tokenizer.

Everything a user can get wrong on the command line fails here with one line that names the
URL, file or flag and the fix, before Ray is imported or started and before transformers is
imported (together 3-14 s on a 2-core machine). The checks cost what they read:

- output: its filesystem opens; a non-empty OUT that is no packshard dataset (or unfinished
  job) is refused; a probe file is written and deleted (`jobstate.check_output`); an OUT inside
  an input directory is refused (a rerun would read the dataset as input);
- inputs: every spec lists at least one readable file (`inputs.resolve_specs`); every file
  of each spec is peeked, PEEK_THREADS at a time (`readers.peek`: a parquet/Arrow footer, or
  the first line of JSON lines), which catches an empty input and a file whose columns the
  column mapping does not match (the error names the file and the columns it has), wherever
  it sits in a glob. A text file whose bytes are compressed (gzip, zstd, xz, bzip2) but whose
  name says plain fails, whatever ``--skip-bad-records`` says. Without ``--skip-bad-records``
  a file whose first record has no sample fields fails too; other bad records are the job's to
  report, in input order (a first line that does not parse is reported here when it is the
  first input's, or when a later file fails: either way it comes first). A file listed twice
  is packed twice, with a warning, and a directory or glob's files of other types are named in
  a warning;
- tokenizer: `tokenizer_loading.locate_tokenizer` (a directory that does not exist, a hub name
  that is offline and not cached, a hub that cannot be reached), without loading it; checked
  before the inputs, so that a file whose first record (or a table whose columns) holds chats
  fails when the tokenizer directory has no chat template (without ``--skip-bad-records``).
  A hub tokenizer's template is known only once it loads: the job then repeats the chat
  check on what preflight read (`Checked.refuse_chats`), still before a local Ray starts.

Measured with local inputs and output on the 2-core development machine, each error arrives
0.3-0.6 s after the command starts (an S3 endpoint that refuses connections: ~6 s of
botocore's own retries).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from packshard.packers import url_to_fs
from packshard.packers.urls import DEMO_SCHEME, UrlError, redact_url, refuse_credentials
from packshard.packers.writer import is_local
from packshard.pipeline.inputs import InputError, InputFile, resolve_specs
from packshard.pipeline.jobstate import OutputError, check_output
from packshard.pipeline.readers import Peek, peek
from packshard.pipeline.samples import BadRecord, Chat, column_problem, source_fields, to_sample
from packshard.pipeline.storage import describe, storage_errors_with
from packshard.pipeline.tokenizer_loading import TokenizerSource, locate_tokenizer

if TYPE_CHECKING:
    from packshard.pipeline.config import PackConfig

PEEK_THREADS = 16  # files of one input spec peeked at once

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checked:
    """What the checks found: the output's filesystem, the input files, the tokenizer's source."""

    fs: Any
    root: str
    files: list[InputFile]
    tokenizer: TokenizerSource | None
    created: bool = False  # the checks created OUT (an empty local directory)
    peeks: list[tuple[InputFile, Peek]] = field(default_factory=list)  # what the checks read

    def refuse_chats(self, cfg: PackConfig) -> None:
        """The per-file chat check again, now that the tokenizer is known to have no chat
        template (a hub tokenizer's files say it only once it loads): on the first records or
        columns already read, so no input is listed or read twice."""
        for f, look in self.peeks:
            _check_peek(cfg, f, look, chat_template=False)

    def discard_output(self) -> None:
        """Remove OUT if the checks created it and it is still empty: a refused job leaves no
        empty OUT behind (stats would call it an empty dataset)."""
        if self.created:
            with contextlib.suppress(OSError):
                self.fs.rmdir(self.root)


def preflight(cfg: PackConfig) -> Checked:
    """Run every check (output, inputs, tokenizer); raises OutputError, InputError, TokenizerError."""
    fs, root, created = open_output(cfg)
    peeks: list[tuple[InputFile, Peek]] = []
    try:
        source = locate_tokenizer(cfg.tokenizer, cfg.tokenizer_revision) if cfg.tokenizer else None
        files = check_inputs(cfg, chat_template=has_chat_template(source), peeks=peeks)
    except BaseException:
        Checked(fs, root, [], None, created).discard_output()
        raise
    return Checked(fs, root, files, source, created, peeks)


def has_chat_template(source: TokenizerSource | None) -> bool | None:
    """Whether the tokenizer has a chat template, from its files (None: not known before it
    loads, or no tokenizer, which the job reports per record)."""
    if source is None:
        return None
    if source.source == "builtin":
        return True
    if source.source != "directory" or source.path is None:
        return None
    for name in ("chat_template.jinja", "chat_template.json"):
        if os.path.isfile(os.path.join(source.path, name)):
            return True
    if os.path.isdir(os.path.join(source.path, "additional_chat_templates")):
        return True
    try:
        with open(os.path.join(source.path, "tokenizer_config.json"), encoding="utf-8") as f:
            return bool(json.load(f).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return None  # the tokenizer's own loading reports what is wrong with it


def open_output(cfg: PackConfig) -> tuple[Any, str, bool]:
    """OUT's filesystem and path, checked (see `jobstate.check_output`), and whether the check
    created OUT (a local directory; object stores have none)."""
    try:
        refuse_credentials(cfg.output)
    except UrlError as e:
        raise OutputError(f"output {e}") from None
    try:
        fs, root = url_to_fs(cfg.output, cfg.storage_options)
    except (ImportError, ValueError) as e:
        raise OutputError(f"output {cfg.output}: {e}") from None
    except storage_errors_with(TypeError) as e:  # ftp:// connects here; a bad storage option
        raise OutputError(
            f"output {cfg.output}: cannot open its filesystem ({describe(e)})"
        ) from None
    _refuse_relative_output_of_a_submitted_job(cfg, fs)
    _check_output_outside_inputs(cfg, fs, root)  # before check_output creates OUT
    existed = not is_local(fs) or fs.exists(root)
    check_output(fs, root, cfg.output)
    return fs, root, not existed


# Ray sets it for the entrypoint of `ray job submit` (the job's runtime env and metadata)
RAY_SUBMITTED_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def _refuse_relative_output_of_a_submitted_job(cfg: PackConfig, fs: Any) -> None:
    """OutputError for a relative local OUT under `ray job submit`: the entrypoint runs in
    Ray's copy of the working directory on the head node (which Ray deletes in time), not in
    the directory the user submitted from, and each node's tasks would resolve it in their own
    copy."""
    if not is_local(fs) or RAY_SUBMITTED_JOB_ENV not in os.environ:
        return
    path = cfg.output.removeprefix("file://")
    if "://" in path or os.path.isabs(os.path.expanduser(path)):
        return
    try:
        job = json.loads(os.environ[RAY_SUBMITTED_JOB_ENV])
        copied = bool((job.get("runtime_env") or {}).get("working_dir"))
    except (ValueError, AttributeError):
        copied = False
    where = (
        f"Ray's copy of the working directory ({os.getcwd()}), which Ray deletes later"
        if copied
        else f"the job's directory on the head node ({os.getcwd()}), not where it was submitted from"
    )
    raise OutputError(
        f"output {cfg.output} is a relative path, and this job was submitted with `ray job "
        f"submit`: it would land in {where}; give an object store URL (s3://, gs://, ...) or "
        "an absolute path on a filesystem every node of the cluster mounts"
    )


def _check_output_outside_inputs(cfg: PackConfig, fs: Any, root: str) -> None:
    """OutputError when OUT lies inside an input directory: the next run (a rerun, a resume)
    would list the dataset's own files as input."""
    out = posixpath.normpath(root)
    for spec in cfg.inputs:
        if spec.startswith(DEMO_SCHEME):
            continue
        try:
            in_fs, path = url_to_fs(spec, cfg.storage_options)
        except (ImportError, ValueError):
            continue  # the input check names it
        if in_fs.protocol != fs.protocol:
            continue
        base = posixpath.normpath(path)
        if out == base or out.startswith(base.rstrip("/") + "/"):
            raise OutputError(
                f"output {cfg.output} lies inside input {spec!r}: a rerun would read the "
                "dataset's own files as input; write it outside the input directory"
            )


def check_inputs(
    cfg: PackConfig,
    *,
    chat_template: bool | None = None,
    peeks: list[tuple[InputFile, Peek]] | None = None,
) -> list[InputFile]:
    """Every input file, in order, after the per-spec checks of the module docstring (each
    file's peek appended to `peeks`, when given). A file listed more than once (the same path
    given twice, overlapping globs) is packed as often as it is listed, with a warning."""
    per_spec = resolve_specs(cfg.inputs, storage_options=cfg.storage_options, split=cfg.split)
    malformed: list[tuple[str, BadRecord]] = []  # first lines that do not parse, in input order
    for number, (spec, files) in enumerate(zip(cfg.inputs, per_spec, strict=True)):
        try:
            looked = _check_spec(cfg, spec, files, chat_template, malformed)
        except InputError:
            if malformed and not cfg.skip_bad_records:  # an earlier file fails the job first
                raise _malformed_error(*malformed[0]) from None
            raise
        first = looked[0][1].first if number == 0 and looked else None
        if malformed and not cfg.skip_bad_records and first and malformed[0][0] == first[0]:
            raise _malformed_error(*malformed[0])  # the first record of all: nothing precedes it
        if peeks is not None:
            peeks += looked
    files = [f for found in per_spec for f in found]
    for url, n in Counter(f.url for f in files).items():
        if n > 1:
            log.warning(
                "input file %s is listed %d times by --input: its records are packed %d times",
                redact_url(url), n, n,
            )  # fmt: skip
    return files


def _malformed_error(location: str, bad: BadRecord) -> InputError:
    return InputError(
        f"{location}: {bad}\n(pass --skip-bad-records to skip such records and count them in "
        "the manifest)"
    )


def _check_spec(
    cfg: PackConfig,
    spec: str,
    files: list[InputFile],
    chat_template: bool | None,
    malformed: list[tuple[str, BadRecord]],
) -> list[tuple[InputFile, Peek]]:
    if all("://" not in f.url and f.size == 0 for f in files):
        raise InputError(
            f"input {spec!r} is empty ({'0 bytes' if len(files) == 1 else f'{len(files)} files of 0 bytes'})"
        )
    if files[0].format == "demo":
        return []
    looks = _peek_all(files, cfg)
    if all(look.records == 0 for look in looks):
        raise InputError(
            f"input {spec!r} holds no records"
            + ("" if len(files) == 1 else f" (none of its {len(files)} files)")
        )
    for f, look in zip(files, looks, strict=True):
        _check_peek(cfg, f, look, chat_template)
        if look.first is not None and isinstance(look.first[1], BadRecord):
            malformed.append((look.first[0], look.first[1]))
    return list(zip(files, looks, strict=True))


def _peek_all(files: list[InputFile], cfg: PackConfig) -> list[Peek]:
    """`readers.peek` of every file, PEEK_THREADS at a time (a footer or a first line each:
    one small read, so a remote glob of hundreds of files takes a few request latencies). The
    first unreadable file in input order raises."""
    fields = source_fields(cfg.columns)
    if len(files) == 1:
        return [peek(files[0], cfg.storage_options, fields)]
    with ThreadPoolExecutor(min(PEEK_THREADS, len(files))) as pool:
        futures = [pool.submit(peek, f, cfg.storage_options, fields) for f in files]
        return [future.result() for future in futures]


def _check_peek(cfg: PackConfig, f: InputFile, look: Peek, chat_template: bool | None) -> None:
    """A file's columns fit the column mapping; without --skip-bad-records, its first record
    holds a sample's fields, and is no chat when the tokenizer has no chat template."""
    no_template = (
        f"the tokenizer {cfg.tokenizer!r} has no chat template, and chats need one: give a "
        "tokenizer that has one (an instruct model's), or --skip-bad-records to leave the chats out"
    )
    if look.columns is not None:
        problem = column_problem(look.columns, kind=cfg.kind, columns=cfg.columns)
        if problem is not None:
            raise InputError(f"input {f.display}: {problem}")
        messages = cfg.columns.get("messages", "messages")
        if (
            chat_template is False
            and not cfg.skip_bad_records
            and cfg.kind in ("auto", "messages")
            and messages in look.columns
        ):
            raise InputError(f"input {f.display} holds chats (column {messages!r}); {no_template}")
    elif look.first is not None and not cfg.skip_bad_records:
        location, record = look.first
        if isinstance(record, BadRecord):
            return  # a malformed line: the job reports the first bad record in input order
        try:
            sample = to_sample(
                record,
                kind=cfg.kind,
                columns=cfg.columns,
                has_chat_template=chat_template is not False,
            )
        except BadRecord as e:
            if e.reason == "missing_fields":
                raise InputError(f"{location}: {e}") from None
            return
        if chat_template is False and isinstance(sample, Chat):
            raise InputError(f"{location}: the record is a chat; {no_template}")
