"""Prepare the wheel folder that ``scripts/device_check.sh`` installs from on an offline card machine.

Run on a networked machine (Python >= 3.11), in the checkout:

    python scripts/device_wheels.py                 # -> .whl/device (git-ignored)
    python scripts/device_wheels.py DIR --python 3.10 3.12 --arch x86_64

The card machine's image ships its own torch, numpy and triton (never carried:
its torch is the one to qualify), and usually pytest, xdist, hypothesis,
psutil and filelock, but no jsonschema. The folder holds, for every
interpreter version and CPU architecture asked for, binary-compatible wheels
of everything else the checkout's distributions and the GPU suite need
(jsonschema and its dependencies, ``rpds-py`` among them, which is compiled;
the test tools as a fallback), the build-system requirements (setuptools) to
build the checkout offline, and the Liger-Kernel wheel (``--no-deps``; it needs the image's
triton) for the benchmark. ``device_check.sh`` installs from it with ``pip
--no-index --find-links``, so whatever is already installed stays and only
what is missing comes from here. The checkout itself travels as source and
is built there (a wheel built here would be stale by the next commit).

Starts from an empty folder (removes the wheels already there), writes
``MANIFEST.json`` (what was asked, file sizes) into it and fails when it
exceeds ``--max-mib`` (default 60; about 19 MiB for the defaults).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root holds `scripts` and `harness`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness.jsonio import write_json
from scripts._common import REPO, Requirement, canonicalize_name, requirements

#: Provided by the card machine's image; never downloaded (the image's torch
#: is what the check qualifies, and these are large).
IMAGE_PROVIDES = {"torch", "numpy", "triton", "nvidia-*"}
#: Needed by the GPU suite's tests beyond the distributions' own requirements.
TEST_TOOLS = ("pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6.100")
#: Besides the pyproject files' build-system requirements: for older setuptools.
BUILD_EXTRA = ("wheel",)
#: Benchmarked against; installed with --no-deps on the card machine.
NO_DEPS = ("liger-kernel",)

PYTHONS = ("3.10", "3.11", "3.12", "3.13", "3.14")
ARCHS = ("x86_64", "aarch64")
# manylinux tags pip should accept for a glibc >= 2.17 image, newest policy first.
GLIBC = ("manylinux_2_28", "manylinux_2_17", "manylinux2014")


def _name(req: str) -> str:
    return canonicalize_name(Requirement(req).name)


def _provided(req: str) -> bool:
    name = _name(req)
    return any(name == p or (p.endswith("*") and name.startswith(p[:-1])) for p in IMAGE_PROVIDES)


def project_requirements(root: Path = REPO) -> list[str]:
    """What installing the checkout's distributions (root and ``harness/`` when it has
    its own ``pyproject.toml``) offline needs: their run-time requirements less what
    the image provides, the test tools, and their build-system requirements (pip's
    isolated build takes setuptools from the folder when the image's is too old)."""
    reqs = [*requirements(root, build_system=True), *TEST_TOOLS, *BUILD_EXTRA]
    return list(dict.fromkeys(r for r in reqs if not _provided(r)))


def _pip_download(dest: Path, *args: str) -> None:
    """``pip download`` binary wheels into ``dest`` (``args``: options, then requirements)."""
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(dest)]
    subprocess.run([*cmd, "--only-binary=:all:", *args], check=True)


def _download(dest: Path, reqs: list[str], python: str, arch: str) -> None:
    platforms = [arg for tag in GLIBC for arg in ("--platform", f"{tag}_{arch}")]
    target = [
        "--implementation",
        "cp",
        "--python-version",
        python,
        "--abi",
        "cp" + python.replace(".", ""),
    ]
    print(f"device_wheels: python {python} {arch}: {' '.join(reqs)}", flush=True)
    _pip_download(dest, *target, *platforms, *reqs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "dest",
        nargs="?",
        default=str(REPO / ".whl" / "device"),
        help="wheel folder (default: .whl/device, git-ignored)",
    )
    parser.add_argument(
        "--python",
        nargs="+",
        default=list(PYTHONS),
        help=f"interpreter versions of the card image (default: {' '.join(PYTHONS)})",
    )
    parser.add_argument("--arch", nargs="+", default=list(ARCHS), choices=ARCHS)
    parser.add_argument("--max-mib", type=float, default=60.0)
    args = parser.parse_args(argv)

    dest = Path(args.dest).resolve()
    dest.mkdir(parents=True, exist_ok=True)
    for stale in dest.glob("*.whl"):  # a previous run's versions would pile up
        stale.unlink()
    reqs = project_requirements()
    for python in args.python:
        for arch in args.arch:
            _download(dest, reqs, python, arch)
    _pip_download(dest, "--no-deps", *NO_DEPS)

    files = sorted(p for p in dest.iterdir() if p.suffix == ".whl")
    total = sum(p.stat().st_size for p in files)
    manifest = {
        "requirements": reqs,
        "no_deps": list(NO_DEPS),
        "python": args.python,
        "arch": args.arch,
        "files": {p.name: p.stat().st_size for p in files},
        "total_bytes": total,
    }
    write_json(dest / "MANIFEST.json", manifest)
    print(f"device_wheels: {len(files)} wheel(s), {total / 2**20:.1f} MiB in {dest}")
    if total > args.max_mib * 2**20:
        print(
            f"device_wheels: {total / 2**20:.1f} MiB exceeds --max-mib {args.max_mib:g}; "
            "the run tool carries at most 64 MiB",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
