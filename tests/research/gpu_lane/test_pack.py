"""research/gpu_lane/pack.py: parts within their limit, a manifest whose sha256 match, a re-join that gives
back the files, an oversize or damaged part refused, and the lane's install from such parts."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "research" / "gpu_lane" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


pack = _load("pack")


def _fake_files(tmp_path: Path) -> dict[str, dict[str, Path]]:
    src = tmp_path / "src"
    src.mkdir(parents=True)
    groups = {"alpha": {}, "beta": {}}
    for group, sizes in (("alpha", [0, 1, 2500]), ("beta", [5000, 999])):
        for i, size in enumerate(sizes):
            path = src / f"{group}_{i}.bin"
            path.write_bytes(os.urandom(size))
            groups[group][f"site/{group}/{path.name}"] = path
    return groups


def _pack_fake(tmp_path: Path, part_bytes: int = 1000):
    files = _fake_files(tmp_path)
    out = tmp_path / "out"
    manifest = pack.pack(list(files), out, part_bytes, root=REPO, files_of=lambda g, root, cache, work: files[g])
    return files, out, manifest


def test_parts_within_the_limit_and_the_manifest_matches(tmp_path):
    files, out, manifest = _pack_fake(tmp_path)
    assert json.loads((out / "manifest.json").read_text()) == manifest
    names = [p["name"] for g in manifest["groups"] for p in g["parts"]]
    assert sorted(names) == sorted(p.name for p in out.glob("*.part*"))
    for group in manifest["groups"]:
        assert len(group["parts"]) == -(-group["bytes"] // 1000)  # the tar cut into 1000-byte parts
        for part in group["parts"]:
            path = out / part["name"]
            assert path.stat().st_size == part["bytes"] <= 1000
            assert pack.sha256_file(path) == part["sha256"]
    # every part named once in the call plan, each call within the room it was planned for
    planned = [n for call in manifest["calls"] for n in call]
    assert sorted(planned) == sorted(names)


def test_rejoin_gives_back_the_files(tmp_path):
    files, out, manifest = _pack_fake(tmp_path)
    for group, members in files.items():
        unpacked = pack.rejoin(out, manifest, group, tmp_path / "stage")
        for name, src in members.items():
            assert (unpacked / name).read_bytes() == src.read_bytes()


def test_an_oversize_or_damaged_part_is_refused(tmp_path):
    with pytest.raises(pack.PackError, match="60 MiB"):
        pack.check_limit(pack.MAX_PART_BYTES + 1)
    files = _fake_files(tmp_path)
    with pytest.raises(pack.PackError, match="60 MiB"):
        pack.pack(list(files), tmp_path / "o", pack.MAX_PART_BYTES + 1, root=REPO, files_of=lambda g, r, c, w: files[g])
    _, out, manifest = _pack_fake(tmp_path / "x")
    # a manifest that claims a part over the limit
    bad = json.loads(json.dumps(manifest))
    bad["groups"][0]["parts"][0]["bytes"] = 1001
    with pytest.raises(pack.PackError, match="over the limit"):
        pack.check_part_sizes(bad)
    # a part grown on the way: refused before its group is re-joined
    part = out / manifest["groups"][1]["parts"][0]["name"]
    part.write_bytes(part.read_bytes() + b"x")
    with pytest.raises(pack.PackError, match="bytes, the manifest says"):
        pack.rejoin(out, manifest, "beta", tmp_path / "stage")
    # a part damaged in place: same size, other bytes
    part.write_bytes(bytes([part.read_bytes()[0] ^ 1]) + part.read_bytes()[1:-1])
    with pytest.raises(pack.PackError, match="sha256"):
        pack.verify_parts(out, manifest)


def test_plan_calls_fits_each_call():
    parts = [{"name": n, "bytes": b} for n, b in (("a", 44), ("b", 44), ("c", 31), ("d", 12), ("e", 11), ("f", 2))]
    calls = pack.plan_calls(parts, 48)
    sizes = {p["name"]: p["bytes"] for p in parts}
    assert sorted(n for c in calls for n in c) == sorted(sizes)
    assert all(sum(sizes[n] for n in call) <= 48 for call in calls)
    assert len(calls) == 4  # 44+2, 44, 31+12, 11


def test_missing_requirements_are_what_the_gpu_machine_lacks():
    missing = pack.missing_requirements()
    for name in ("ray", "verl", "hydra-core", "omegaconf", "antlr4-python3-runtime", "cryptography"):
        assert name in missing, name
    for name in ("torch", "transformers", "numpy", "pyarrow", "triton", "heterorl", "wandb"):
        assert name not in missing, name
    assert pack.wheel_group("ray") == "ray" and pack.wheel_group("omegaconf") == "wheels-core"


def test_code_group_carries_the_project_with_its_entry_points(tmp_path):
    manifest = pack.pack(["code"], tmp_path / "out", 4 * pack.MIB)
    assert all(p["bytes"] <= 4 * pack.MIB for p in manifest["groups"][0]["parts"])
    unpacked = pack.rejoin(tmp_path / "out", manifest, "code", tmp_path / "stage")
    assert (unpacked / "tree" / "configs" / "verl_preset" / "cpu_toy.yaml").is_file()
    assert (unpacked / "tree" / "research" / "gpu_lane" / "lane.py").is_file()
    assert (unpacked / "tree" / "scripts" / "bench" / "bench_losses.py").is_file()  # the lane's list of losses
    (wheel,) = (unpacked / "wheels").glob("heterorl-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        entry_points = zf.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "verl_ext/algos/losses.py" in names and "recipe/gepo/main_gepo.py" in names
    assert "[verl.plugins]" in entry_points and "heterorl = verl_ext.algos.registry" in entry_points


def test_tracked_files_outside_a_git_checkout(tmp_path):
    (tmp_path / "verl_ext" / "sub").mkdir(parents=True)
    (tmp_path / "verl_ext" / "sub" / "a.py").write_text("")
    (tmp_path / "verl_ext" / "__pycache__").mkdir()
    (tmp_path / "verl_ext" / "__pycache__" / "a.cpython-312.pyc").write_bytes(b"")
    (tmp_path / "pyproject.toml").write_text("")
    found = pack.tracked_files(tmp_path, ["verl_ext", "pyproject.toml", "README.md"])
    assert [p.relative_to(tmp_path).as_posix() for p in found] == ["pyproject.toml", "verl_ext/sub/a.py"]


def test_project_metadata_carries_the_entry_points(tmp_path):
    import importlib.metadata

    pack.write_project_metadata(REPO, tmp_path)
    (dist,) = importlib.metadata.distributions(path=[str(tmp_path)])
    assert dist.metadata["Name"] == "heterorl"
    plugins = {ep.name: ep.value for ep in dist.entry_points if ep.group == "verl.plugins"}
    assert plugins == {"heterorl": "verl_ext.algos.registry", "heterorl_cpu": "verl_ext.cpu"}


def _tiny_wheel(dest: Path) -> Path:
    wheel = dest / "lanetoy-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("lanetoy/__init__.py", "VALUE = 42\n")
        zf.writestr("lanetoy-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: lanetoy\nVersion: 1.0\n")
        zf.writestr(
            "lanetoy-1.0.dist-info/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        zf.writestr("lanetoy-1.0.dist-info/RECORD", "")
    return wheel


def test_lane_installs_from_parts(tmp_path):
    lane = _load("lane")
    src = tmp_path / "src"
    src.mkdir()
    (src / "data.txt").write_text("gsm8k\n")
    files = {"wheels/lanetoy-1.0-py3-none-any.whl": _tiny_wheel(src), "site/lanedata/data.txt": src / "data.txt"}
    parts = tmp_path / "parts"
    # named "code": the lane then builds no project wheel from the checkout
    pack.pack(["code"], parts, 300, root=REPO, files_of=lambda g, r, c, w: files)
    site = tmp_path / "site"
    log = lane.install(parts, site, tmp_path / "stage")
    assert any("sha256 ok" in line for line in log)
    assert (site / "lanetoy" / "__init__.py").read_text() == "VALUE = 42\n"
    assert (site / "lanedata" / "data.txt").read_text() == "gsm8k\n"
    # a damaged part: that group is not installed, and the log says so
    first = sorted(parts.glob("*.part*"))[0]
    first.write_bytes(b"\0" * first.stat().st_size)
    log = lane.install(parts, tmp_path / "site2", tmp_path / "stage2")
    assert any("not installed" in line and "sha256" in line for line in log)
    assert not (tmp_path / "site2" / "lanetoy").exists()


def test_packed_tar_is_deterministic(tmp_path):
    files = _fake_files(tmp_path)["alpha"]
    pack.write_tar(files, tmp_path / "one.tar")
    pack.write_tar(files, tmp_path / "two.tar")
    assert pack.sha256_file(tmp_path / "one.tar") == pack.sha256_file(tmp_path / "two.tar")
    with tarfile.open(tmp_path / "one.tar") as tar:
        assert sorted(tar.getnames()) == sorted(files)
