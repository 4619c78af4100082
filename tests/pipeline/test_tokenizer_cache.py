"""The driver's tokenizer cache: a hit gives what a fresh load gives, without transformers; any
change to the files, versions or template arguments misses; a damaged entry is a miss; the
checks a hit skips are only those a fresh load already passed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from packshard.pipeline import pack, tokenizer_cache
from packshard.pipeline.config import config_from_args
from packshard.pipeline.tokenizer_loading import (
    TokenizerError,
    TokenizerSource,
    load_located,
    locate_tokenizer,
)

pytestmark = [pytest.mark.shared]

REPO = Path(__file__).resolve().parents[2]
QWEN = "tokenizers/qwen2.5-instruct"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("PACKSHARD_CACHE_DIR", str(root))
    monkeypatch.delenv("PACKSHARD_TOKENIZER_CACHE", raising=False)
    return root / "tokenizers"


@pytest.fixture
def tok_dir(shared_data: Path, tmp_path: Path) -> Path:
    """A private copy of the Qwen2.5 tokenizer, free to edit."""
    return Path(shutil.copytree(shared_data / QWEN, tmp_path / "qwen"))


def prepare(tok: Path, *extra: str) -> pack.DriverTokenizer:
    cfg = config_from_args(
        ["--input", "x.jsonl", "--output", "out", "--tokenizer", str(tok),
         "--seq-len", "4096", "--cp", "8", *extra]
    )  # fmt: skip
    return pack.prepare_tokenizer(cfg, locate_tokenizer(str(tok)))


def refuse_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_: object) -> None:
        raise AssertionError("the tokenizer was loaded instead of coming from the cache")

    monkeypatch.setattr(pack, "load_located", fail)


def test_a_hit_equals_a_fresh_load(cache: Path, tok_dir: Path, monkeypatch: pytest.MonkeyPatch):
    fresh = prepare(tok_dir)
    assert not fresh.cached and len(list(cache.glob("*.json"))) == 1
    refuse_loading(monkeypatch)
    hit = prepare(tok_dir)
    assert hit.cached
    assert hit.info == fresh.info and hit.pad_token_id == fresh.pad_token_id
    assert hit.encoder is not None and fresh.encoder is not None
    assert hit.encoder.payload == fresh.encoder.payload
    assert hit.encoder.profile == fresh.encoder.profile
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    from packshard.pipeline.samples import Chat

    sample = Chat(messages=chat, tools=None)
    [a], [b] = hit.encoder.encode([sample]), fresh.encoder.encode([sample])
    assert a.ids.tolist() == b.ids.tolist() and a.mask.tolist() == b.mask.tolist()


def test_a_hit_in_a_fresh_process_imports_neither_transformers_nor_torch(
    cache: Path, tok_dir: Path, tmp_path: Path
):
    script = tmp_path / "driver.py"
    script.write_text(
        textwrap.dedent(f"""
            import json, sys
            from packshard.pipeline import pack
            from packshard.pipeline.config import config_from_args
            from packshard.pipeline.tokenizer_loading import locate_tokenizer
            cfg = config_from_args(["--input", "x.jsonl", "--output", "out", "--tokenizer",
                                    {str(tok_dir)!r}, "--seq-len", "4096", "--cp", "8"])
            t = pack.prepare_tokenizer(cfg, locate_tokenizer({str(tok_dir)!r}))
            print(json.dumps([t.cached, t.info, t.pad_token_id,
                              "transformers" in sys.modules, "torch" in sys.modules]))
        """)
    )

    def driver() -> list:
        out = subprocess.run(
            [sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, check=True
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    first, second = driver(), driver()
    assert first[0] is False and first[3] is True  # loaded with transformers
    assert second == [True, first[1], first[2], False, False]


def test_changed_files_versions_or_template_arguments_miss(
    cache: Path, tok_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    src = locate_tokenizer(str(tok_dir))
    key = tokenizer_cache.cache_key(src, False, {})
    assert key is not None and key == tokenizer_cache.cache_key(src, False, {})
    assert tokenizer_cache.cache_key(src, False, {"enable_thinking": False}) != key
    (tok_dir / "model.safetensors").write_bytes(b"weights are not part of a tokenizer")
    assert tokenizer_cache.cache_key(src, False, {}) == key
    (tok_dir.parent / "shared_templates").mkdir()
    template = tok_dir.parent / "shared_templates" / "tool_use.jinja"
    template.write_text("{{ messages }}")
    (tok_dir / "additional_chat_templates").symlink_to(tok_dir.parent / "shared_templates")
    with_template = tokenizer_cache.cache_key(src, False, {})
    assert with_template != key  # read through the symlinked directory
    template.write_text("{{ messages | length }}")
    assert tokenizer_cache.cache_key(src, False, {}) not in (key, with_template)
    template.write_text("{{ messages }}")
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 7}))
    assert tokenizer_cache.cache_key(src, False, {}) not in (key, with_template)
    real = tokenizer_cache._version
    monkeypatch.setattr(
        tokenizer_cache, "_version", lambda d: "0.0" if d == "transformers" else real(d)
    )
    assert tokenizer_cache.cache_key(src, False, {}) not in (key, with_template)
    # never cached: code from the tokenizer's repository, the built-in tokenizer, a moving
    # hub revision; a hub commit is
    assert tokenizer_cache.cache_key(src, True, {}) is None
    assert tokenizer_cache.cache_key(locate_tokenizer("packshard:demo"), False, {}) is None
    hub = TokenizerSource("Qwen/Qwen3-8B", "hub", revision="main")
    assert tokenizer_cache.cache_key(hub, False, {}) is None
    commit = TokenizerSource("Qwen/Qwen3-8B", "hub", revision="a" * 40)
    assert tokenizer_cache.cache_key(commit, False, {}) is not None
    # nor a directory too large to be a tokenizer's (a model tree with checkpoints, data)
    monkeypatch.setattr(tokenizer_cache, "MAX_HASHED_FILES", 2)
    assert tokenizer_cache.cache_key(src, False, {}) is None


def test_an_edited_template_is_loaded_again(cache: Path, tok_dir: Path):
    first = prepare(tok_dir)
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace("<|im_start|>", "<|im_start|> ", 1)
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    load_located.cache_clear()  # the process's own memo of loaded tokenizers
    second = prepare(tok_dir)
    assert not second.cached
    assert second.info is not None and first.info is not None
    assert second.info["fingerprint"] != first.info["fingerprint"]
    assert len(list(cache.glob("*.json"))) == 2


@pytest.mark.parametrize(
    "damage", ["truncate", "payload", "eos", "pad", "format", "not_an_object", "deep"]
)
def test_a_damaged_entry_is_a_miss_and_is_rewritten(cache: Path, tok_dir: Path, damage: str):
    fresh = prepare(tok_dir)
    [entry] = cache.glob("*.json")
    if damage == "truncate":
        entry.write_bytes(entry.read_bytes()[:1000])
    elif damage == "not_an_object":
        entry.write_text("null")
    elif damage == "deep":  # json raises RecursionError, not a ValueError
        entry.write_text("[" * 100_000 + "]" * 100_000)
    else:
        data = json.loads(entry.read_text())
        if damage == "payload":  # a token id changed: the entry's digest no longer matches
            data["payload"]["tokenizer_json"] = data["payload"]["tokenizer_json"].replace(
                '"!":0', '"!":1', 1
            )
            assert (
                data["payload"]["tokenizer_json"]
                != json.loads(entry.read_text())["payload"]["tokenizer_json"]
            )
        elif damage == "eos":  # outside the payload's fingerprint: the digest covers it
            data["payload"]["eos_token_id"] = 5
        elif damage == "pad":
            data["pad_token_id"] = 0
        else:
            data["format"] = 99
        entry.write_text(json.dumps(data))
    again = prepare(tok_dir)
    assert not again.cached and again.info == fresh.info
    assert prepare(tok_dir).cached  # rewritten


def test_a_hit_still_checks_the_loss_roles_and_the_pad_token(
    cache: Path, tok_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = (  # renders user and assistant turns only
        "{% for m in messages %}{% if m.role in ['user', 'assistant'] %}<|im_start|>{{ m.role }}\n"
        "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    assert not prepare(tok_dir).cached
    refuse_loading(monkeypatch)
    with pytest.raises(TokenizerError, match="--loss-roles tool: the chat template renders none"):
        prepare(tok_dir, "--loss-roles", "tool")
    assert prepare(tok_dir, "--pad-token-id", "7").pad_token_id == 7
    with pytest.raises(TokenizerError, match=r"--pad-token-id 99999999 is outside the tokenizer's"):
        prepare(tok_dir, "--pad-token-id", "99999999")


def test_an_unusable_or_disabled_cache_never_fails_the_job(
    tmp_path: Path, tok_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    blocker = tmp_path / "not_a_directory"
    blocker.write_text("")
    monkeypatch.setenv("PACKSHARD_CACHE_DIR", str(blocker))
    assert not prepare(tok_dir).cached and not prepare(tok_dir).cached
    monkeypatch.setenv("PACKSHARD_CACHE_DIR", str(tmp_path / "off"))
    monkeypatch.setenv("PACKSHARD_TOKENIZER_CACHE", "0")
    assert not prepare(tok_dir).cached and not prepare(tok_dir).cached
    assert not (tmp_path / "off").exists()


def test_the_cache_keeps_the_most_recently_used_entries(
    cache: Path, monkeypatch: pytest.MonkeyPatch
):
    import os
    import time

    from packshard.pipeline.tokenizer_loading import TokenizerPayload

    monkeypatch.setattr(tokenizer_cache, "MAX_ENTRIES", 3)
    payload = TokenizerPayload(name="t", fingerprint="", tokenizer_json="{}")
    payload = TokenizerPayload(
        name="t", fingerprint=payload.computed_fingerprint(), tokenizer_json="{}"
    )
    now = time.time()
    for i in range(5):
        tokenizer_cache.write(f"k{i}", payload, 0)
        os.utime(cache / f"k{i}.json", (now - 100 + i, now - 100 + i))
    assert tokenizer_cache.read("k0", "t") is None  # pruned when k3 and k4 were written
    assert tokenizer_cache.read("k2", "t") is not None  # used now: the newest
    tokenizer_cache.write("k5", payload, 0)
    assert sorted(p.stem for p in cache.glob("*.json")) == ["k2", "k4", "k5"]


def test_a_cache_key_that_cannot_be_computed_is_no_cache(
    cache: Path, tok_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    """An install without packshard's .py sources (compiled only): no key, a plain load."""
    monkeypatch.setattr(tokenizer_cache, "OWN_CODE", (*tokenizer_cache.OWN_CODE, "gone.py"))
    assert not prepare(tok_dir).cached and not prepare(tok_dir).cached
    assert not cache.exists() or not list(cache.glob("*.json"))


def test_files_edited_during_the_load_are_not_stored(
    cache: Path, tok_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    config = tok_dir / "tokenizer_config.json"
    before = config.read_text()
    load = pack.load_located

    def edit_then_load(source: TokenizerSource, trust_remote_code: bool) -> object:
        data = json.loads(before)
        data["chat_template"] = data["chat_template"].replace("<|im_start|>", "<|im_start|> ", 1)
        config.write_text(json.dumps(data))  # lands after the key was taken
        return load(source, trust_remote_code)

    monkeypatch.setattr(pack, "load_located", edit_then_load)
    assert not prepare(tok_dir).cached
    assert not list(cache.glob("*.json"))  # a revert of the edit would otherwise hit it
    monkeypatch.setattr(pack, "load_located", load)
    config.write_text(before)
    assert not prepare(tok_dir).cached and prepare(tok_dir).cached


def test_an_offline_hub_snapshot_that_gains_files_misses(shared_data: Path, tmp_path: Path):
    """Offline, a hub tokenizer loads from whatever the local Hugging Face cache holds of its
    commit; a snapshot that gains a file (a fuller download later) is another key."""
    script = textwrap.dedent(
        f"""
        import json, os, shutil, sys
        from pathlib import Path
        root = Path({str(tmp_path)!r})
        commit = "0123456789abcdef0123456789abcdef01234567"
        repo = root / "hf" / "models--acme--tok"
        snap = repo / "snapshots" / commit
        shutil.copytree({str(shared_data / QWEN)!r}, snap)
        (snap / "config.json").write_text(json.dumps({{"model_type": "qwen2"}}))
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(commit)
        os.environ.update(HF_HUB_CACHE=str(root / "hf"), HF_HUB_OFFLINE="1",
                          PACKSHARD_CACHE_DIR=str(root / "cache"))
        from packshard.pipeline import pack
        from packshard.pipeline.config import config_from_args
        from packshard.pipeline.tokenizer_loading import load_located, locate_tokenizer
        cfg = config_from_args(["--input", "x.jsonl", "--output", "out", "--tokenizer",
                                "acme/tok", "--seq-len", "4096", "--cp", "8"])
        def prepare():
            load_located.cache_clear()
            t = pack.prepare_tokenizer(cfg, locate_tokenizer("acme/tok"))
            return [t.cached, t.info["fingerprint"]]
        got = [prepare(), prepare()]
        (snap / "chat_template.jinja").write_text(
            "{{% for m in messages %}}[{{{{ m.role }}}}]{{{{ m.content }}}}{{% endfor %}}"
            "{{% if add_generation_prompt %}}[assistant]{{% endif %}}")
        got += [prepare(), prepare()]
        print(json.dumps(got))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (miss, fp1), (hit, fp2), (miss2, fp3), (hit2, fp4) = json.loads(out.stdout.splitlines()[-1])
    assert (miss, hit, miss2, hit2) == (False, True, False, True)
    assert fp1 == fp2 != fp3 == fp4


def test_pruning_removes_only_stale_temporary_files(cache: Path):
    import os
    import time

    from packshard.pipeline.tokenizer_loading import TokenizerPayload

    cache.mkdir(parents=True)
    stale, fresh = cache / ".tmp-dead.json", cache / ".tmp-writing.json"
    for p in (stale, fresh):
        p.write_text("{")
    old = time.time() - tokenizer_cache.STALE_TMP_S - 60
    os.utime(stale, (old, old))
    tokenizer_cache.write("k", TokenizerPayload(name="t", fingerprint="f"), 0)
    assert not stale.exists() and fresh.exists() and (cache / "k.json").exists()
