"""Where --tokenizer comes from, decided before anything is loaded (`locate_tokenizer`), and how
the manifest records it."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from packshard.pipeline import tokenizer_loading as tl
from packshard.pipeline.tokenizer_loading import TokenizerError, TokenizerSource, locate_tokenizer


@pytest.fixture
def tok_dir(tmp_path: Path) -> Path:
    d = tmp_path / "tokenizers" / "qwen2.5-instruct"
    d.mkdir(parents=True)
    (d / "tokenizer.json").write_text("{}")
    (d / "tokenizer_config.json").write_text("{}")
    return d


def test_a_directory_is_recorded_by_its_name_not_the_path_as_typed(tok_dir: Path, monkeypatch):
    monkeypatch.chdir(tok_dir.parent.parent)
    src = locate_tokenizer("./tokenizers/qwen2.5-instruct")
    assert src.source == "directory" and src.path == str(tok_dir)
    assert src.manifest_entry("sha256:ab") == {
        "name": "qwen2.5-instruct",
        "source": "directory",
        "fingerprint": "sha256:ab",
    }
    # the same tokenizer typed another way is the same entry (a rerun resumes, not refused)
    assert locate_tokenizer(str(tok_dir) + "/").manifest_entry("f") == src.manifest_entry("f")


def test_a_mistyped_directory_says_it_does_not_exist_and_names_the_closest(
    tok_dir: Path, monkeypatch
):
    monkeypatch.chdir(tok_dir.parent.parent)
    with pytest.raises(TokenizerError) as e:
        locate_tokenizer("./tokenizers/qwen25-instruct")
    assert str(e.value) == (
        "tokenizer directory './tokenizers/qwen25-instruct' does not exist; "
        "did you mean './tokenizers/qwen2.5-instruct'?"
    )
    assert "Repo id" not in str(e.value)
    with pytest.raises(TokenizerError, match=r"'\.\./x/y' does not exist"):
        locate_tokenizer("../x/y")
    with pytest.raises(TokenizerError, match="holds no tokenizer files"):
        locate_tokenizer(str(tok_dir.parent))
    (tok_dir / "vocab.bin").write_text("")
    with pytest.raises(TokenizerError, match="is a file"):
        locate_tokenizer(str(tok_dir / "vocab.bin"))


def test_offline_hub_name_not_in_the_cache_fails_at_once(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(tl, "_hub_commit", lambda *a: pytest.fail("no request when offline"))
    monkeypatch.setattr(tl, "_cached_revision", lambda name, rev: None)
    with pytest.raises(
        TokenizerError, match="not in the Hugging Face cache and HF_HUB_OFFLINE is set"
    ):
        locate_tokenizer("Qwen/Qwen3-8B")


def test_offline_hub_name_in_the_cache_loads_from_it(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(tl, "_cached_revision", lambda name, rev: "abc123")
    src = locate_tokenizer("Qwen/Qwen3-8B")
    assert src == TokenizerSource("Qwen/Qwen3-8B", "hub", revision="abc123", local_files_only=True)
    assert src.manifest_entry("f") == {
        "name": "Qwen/Qwen3-8B",
        "source": "hub",
        "fingerprint": "f",
        "revision": "abc123",
    }


def test_online_hub_name_is_resolved_to_its_commit(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(tl, "_hub_commit", lambda name, rev: f"{rev}-sha")
    assert locate_tokenizer("Qwen/Qwen3-8B", "v1").revision == "v1-sha"


def test_unreachable_hub_fails_in_one_request_without_retries(monkeypatch):
    """A real request to a hub endpoint that refuses connections: one attempt, no backoff."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: connections are refused
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(tl, "_cached_revision", lambda name, rev: None)
    calls = []
    real = tl._hub_commit
    monkeypatch.setattr(tl, "_hub_commit", lambda *a: calls.append(a) or real(*a))
    with pytest.raises(
        TokenizerError, match=r"the Hugging Face hub cannot be reached .*not in the local cache"
    ):
        locate_tokenizer("Qwen/Qwen3-8B")
    assert len(calls) == 1


def test_locating_imports_neither_transformers_nor_ray():
    code = (
        "import sys\n"
        "from packshard.pipeline.tokenizer_loading import locate_tokenizer, TokenizerError\n"
        "try:\n    locate_tokenizer('./no/such/dir')\nexcept TokenizerError:\n    pass\n"
        "print(sorted(m for m in ('transformers', 'ray', 'torch') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
