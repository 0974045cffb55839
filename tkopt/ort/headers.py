"""ONNX Runtime's C/C++ API headers, which the ORT wheel does not ship.

They come from the npm package com.github.asus4.onnxruntime (fetched with npm, the registry's
ordinary client, once, into the tkopt cache) or from a directory the user names with
TKOPT_ORT_INCLUDE. Nothing third-party is kept in the repository.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

NPM_PACKAGE = "com.github.asus4.onnxruntime@0.4.9"
REQUIRED = ("onnxruntime_c_api.h", "onnxruntime_cxx_api.h", "onnxruntime_cxx_inline.h")
# The Linux-neutral copy inside the package (every platform's copy of the headers is the same text).
_MEMBER_DIR = "package/Plugins/iOS~/onnxruntime.xcframework/ios-arm64_x86_64-simulator/onnxruntime.framework/Headers/"


class HeadersError(RuntimeError):
    """The ORT headers could not be found or fetched; the message says how to provide them."""


def api_version(include_dir: Path) -> int:
    """ORT_API_VERSION the headers declare (a library built with them needs a runtime at least that new)."""
    text = (include_dir / "onnxruntime_c_api.h").read_text()
    m = re.search(r"#define ORT_API_VERSION (\d+)", text)
    if not m:
        raise HeadersError(f"{include_dir}/onnxruntime_c_api.h has no ORT_API_VERSION")
    return int(m.group(1))


def _complete(d: Path) -> bool:
    return all((d / h).is_file() for h in REQUIRED)


def include_dir(fetch: bool = True) -> Path:
    """The directory holding the ORT headers: $TKOPT_ORT_INCLUDE, the cache, or a fresh npm fetch."""
    named = os.environ.get("TKOPT_ORT_INCLUDE")
    if named:
        d = Path(named)
        if not _complete(d):
            raise HeadersError(f"TKOPT_ORT_INCLUDE={named} lacks one of {', '.join(REQUIRED)}")
        return d
    from tkopt.cache import cache_path

    d = cache_path("ort-include", NPM_PACKAGE.replace("@", "-"))
    if _complete(d):
        return d
    if not fetch:
        raise HeadersError(f"ORT headers not in {d}; run `tkopt fetch-headers` or set TKOPT_ORT_INCLUDE")
    return _fetch(d)


def _fetch(dest: Path) -> Path:
    npm = shutil.which("npm")
    if npm is None:
        raise HeadersError(
            "building the ORT op library needs ONNX Runtime's C API headers; npm is not installed to fetch "
            f"{NPM_PACKAGE}. Install npm, or set TKOPT_ORT_INCLUDE to a directory with {', '.join(REQUIRED)}"
        )
    from tkopt import progress

    with tempfile.TemporaryDirectory() as tmp, progress.step(f"fetching ONNX Runtime's C API headers ({NPM_PACKAGE}, "
                                                             "npm, first build only)"):
        try:
            proc = subprocess.run([npm, "pack", NPM_PACKAGE, "--silent"], cwd=tmp, capture_output=True, text=True,
                                  timeout=300)
        except subprocess.TimeoutExpired:
            proc = subprocess.CompletedProcess([], 1, "", "no answer in 300 s")
        tgz = next(Path(tmp).glob("*.tgz"), None)
        if proc.returncode != 0 or tgz is None:
            said = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
            raise HeadersError(f"`npm pack {NPM_PACKAGE}` failed ({said[0] if said else f'exit {proc.returncode}'}): "
                               "the first op library build fetches ONNX Runtime's C API headers from the npm "
                               "registry, so it needs the network once; or set TKOPT_ORT_INCLUDE to a directory "
                               f"with {', '.join(REQUIRED)}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=dest.parent))  # same filesystem, so os.replace is atomic
        try:
            with tarfile.open(tgz) as tar:
                for member in tar.getmembers():
                    if member.name.startswith(_MEMBER_DIR) and member.name.endswith(".h") and member.isfile():
                        src = tar.extractfile(member)
                        assert src is not None
                        (staging / Path(member.name).name).write_bytes(src.read())
            if not _complete(staging):
                raise HeadersError(f"{NPM_PACKAGE} did not contain {', '.join(REQUIRED)}")
            if dest.exists():
                shutil.rmtree(dest)
            os.replace(staging, dest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return dest


if __name__ == "__main__":
    print(include_dir())
