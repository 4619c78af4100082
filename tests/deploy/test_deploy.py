"""deploy/ stays consistent with the code: manifests parse, the image runs our Ray and Python,
every entrypoint flag is one pack.py accepts, and every referenced file exists."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import tomllib
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUBERAY = sorted(DEPLOY.glob("kuberay/*.yaml"))
MANIFESTS = [*KUBERAY, DEPLOY / "cluster-aws.yaml"]


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _pinned_ray() -> str:
    for dep in _pyproject()["project"]["optional-dependencies"]["pack"]:
        m = re.fullmatch(r"ray\[default\]==([\d.]+)", dep.replace(" ", ""))
        if m:
            return m.group(1)
    raise AssertionError(
        "pyproject.toml's [pack] extra must pin ray[default]==X (the image must run the same Ray)"
    )


def _image_tag() -> tuple[str, str]:
    text = (DEPLOY / "Dockerfile").read_text()
    m = re.search(r"^FROM rayproject/ray:([\d.]+)-py(\d)(\d+)\S*\s*$", text, re.M)
    assert m, "deploy/Dockerfile must start FROM rayproject/ray:<version>-py<XY>"
    return m.group(1), f"{m.group(2)}.{m.group(3)}"


def test_manifests_parse():
    assert [p.name for p in KUBERAY] == ["raycluster.yaml", "rayjob-pack.yaml"]
    for path in MANIFESTS:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs, f"{path} is empty"


def test_image_ray_and_python_match_pyproject():
    ray_version, python = _image_tag()
    assert ray_version == _pinned_ray()
    classifiers = _pyproject()["project"]["classifiers"]
    assert f"Programming Language :: Python :: {python}" in classifiers
    floor = _pyproject()["project"]["requires-python"].removeprefix(">=")
    assert tuple(map(int, python.split("."))) >= tuple(map(int, floor.split(".")))


def test_kuberay_ray_version_matches():
    for path in KUBERAY:
        for doc in yaml.safe_load_all(path.read_text()):
            spec = doc["spec"].get("rayClusterSpec", doc["spec"])
            assert spec["rayVersion"] == _pinned_ray(), path


def _entrypoints() -> list[tuple[Path, list[str]]]:
    found = []
    for path in KUBERAY:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc.get("kind") == "RayJob":
                found.append((path, shlex.split(doc["spec"]["entrypoint"])))
    # commands in deploy/README.md's code blocks, continuation lines joined
    readme = (DEPLOY / "README.md").read_text()
    for block in re.findall(r"```bash\n(.*?)```", readme, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            at = line.find("python -m packshard.pipeline.pack")
            if at >= 0:
                found.append((DEPLOY / "README.md", shlex.split(line[at:].split("#")[0])))
    return found


def test_every_entrypoint_flag_is_accepted_by_pack():
    from packshard.pipeline.config import build_parser

    entries = _entrypoints()
    assert any(p.suffix == ".yaml" for p, _ in entries), "the RayJob must have an entrypoint"
    for path, argv in entries:
        assert argv[:3] == ["python", "-m", "packshard.pipeline.pack"], (
            f"{path}: entrypoint must run python -m packshard.pipeline.pack"
        )
        args = [a for a in argv[3:] if a != "\\"]
        parser = build_parser()
        try:
            parser.parse_args(args)
        except SystemExit:
            pytest.fail(f"{path}: pack.py rejects the entrypoint flags {args}")


def test_pack_rejects_unknown_flags():
    """The check above can fail: a flag pack.py does not know is rejected."""
    from packshard.pipeline.config import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--output", "x", "--no-such-flag"])


def test_referenced_files_exist():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    for src in re.findall(r"^COPY\s+(?:--\S+\s+)*(.+?)\s+\S+\s*$", dockerfile, re.M):
        for name in src.split():
            assert (REPO / name).exists(), f"Dockerfile copies {name}, which does not exist"
    text = (DEPLOY / "README.md").read_text()
    for name in re.findall(r"`((?:deploy|docs|benchmarks|tests)/[\w./-]+)`", text):
        assert (REPO / name).exists() or list(REPO.glob(name)), (
            f"deploy/README.md names {name}, which does not exist"
        )


def test_no_credentials_in_manifests():
    for path in MANIFESTS:
        text = path.read_text()
        assert not re.search(r"AKIA[0-9A-Z]{16}", text), f"{path} holds an AWS access key"
        assert not re.search(r"(?i)secret_access_key\s*[:=]\s*\S{20,}", text), (
            f"{path} holds a secret"
        )


def test_shm_is_memory_backed():
    for path in KUBERAY:
        for doc in yaml.safe_load_all(path.read_text()):
            spec = doc["spec"].get("rayClusterSpec", doc["spec"])
            groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
            for g in groups:
                pod = g["template"]["spec"]
                shm = [v for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
                assert shm, f"{path}: a group has no memory-backed volume"
                mounts = [
                    m
                    for c in pod["containers"]
                    for m in c.get("volumeMounts", [])
                    if m["mountPath"] == "/dev/shm"
                ]
                assert mounts, f"{path}: a group does not mount /dev/shm"


def test_every_kuberay_container_gets_the_storage_and_hub_secrets():
    """deploy/README.md: keys from packshard-aws (envFrom), a gated tokenizer's token from
    packshard-hf (as HF_TOKEN), both optional, on the head and the workers of both manifests."""
    for path in KUBERAY:
        for doc in yaml.safe_load_all(path.read_text()):
            spec = doc["spec"].get("rayClusterSpec", doc["spec"])
            groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
            for group in groups:
                for c in group["template"]["spec"]["containers"]:
                    refs = [e["secretRef"] for e in c.get("envFrom", [])]
                    assert {"name": "packshard-aws", "optional": True} in refs, (path, c["name"])
                    env = {e["name"]: e for e in c.get("env", [])}
                    ref = env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]
                    assert ref == {"name": "packshard-hf", "key": "token", "optional": True}, path
