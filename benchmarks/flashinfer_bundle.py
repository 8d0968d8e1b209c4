"""FlashInfer for the GPU machine, which has no package index and takes 64 MiB per call: the
``flashinfer-python`` wheel (101 MB, py3-none-any) pruned to what ``import flashinfer`` and
its batch prefill over a paged KV cache need (the Hopper ``fa3`` backend and the ``fa2`` one
for head size 512), as one reproducible ``.fi/flashinfer.tar.xz`` (about 9 MB), and the
small wheels it imports added to ``.whl/``. ``benchmarks/device_env.sh`` unpacks it when
``.fi`` is carried; FlashInfer then JIT-builds each kernel variant with the machine's nvcc at
its first use (minutes: one module per dtype x head size x window x soft cap).

    python3 benchmarks/flashinfer_bundle.py [--version 0.7.4] [--wheel WHL]

What is kept:
  * Python: the closure of flashinfer's imports from ``flashinfer/__init__.py`` (module
    level and inside functions, ``import_module`` of literal names);
  * the header trees whole (include, cutlass, cccl, spdlog: 57 MB raw, ~4 MB compressed;
    cccl must stay, it shadows the toolkit's older copy on the include path);
  * of ``data/csrc`` (389 MB): the top-level headers and the batch-prefill sources and
    templates below, with every csrc file they include;
  * the dist-info's metadata and licenses.
"""

from __future__ import annotations

import argparse
import ast
import io
import posixpath
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = "flashinfer/data/"
CSRC = DATA + "csrc/"
HEADER_TREES = [
    DATA + "include/", DATA + "cutlass/include/", DATA + "cutlass/tools/util/include/",
    DATA + "cccl/", DATA + "spdlog/include/",
]  # fmt: skip
LICENSES = re.compile(r"^flashinfer/data/(cutlass|spdlog|cccl)/[^/]*(LICENSE|COPYING|NOTICE)", re.I)
CSRC_SOURCES = [  # batch prefill: fa3 (sm90, bf16/fp16 and fp8), fa2 (head size 512)
    "batch_prefill_sm90_customize_config.jinja", "batch_prefill_paged_sm90_kernel_inst.jinja",
    "batch_prefill_ragged_sm90_kernel_inst.jinja", "batch_prefill_sm90.cu",
    "batch_prefill_sm90_jit_binding.cu", "batch_prefill_fp8_paged_sm90_kernel_inst.jinja",
    "batch_prefill_fp8_ragged_sm90_kernel_inst.jinja", "batch_prefill_fp8_sm90.cu",
    "batch_prefill_customize_config.jinja", "batch_prefill_paged_kernel_inst.jinja",
    "batch_prefill_ragged_kernel_inst.jinja", "batch_prefill.cu",
    "batch_prefill_jit_binding.cu", "batch_prefill_paged.cu",
    "batch_prefill_paged_jit_binding.cu", "batch_prefill_paged.cuh",
]  # fmt: skip
DIST_INFO = re.compile(r"^[^/]+\.dist-info/(METADATA|WHEEL|top_level\.txt|licenses/.*)$")
# imported by flashinfer and missing on the GPU machine (torch brings jinja2 and filelock);
# ninja is run as a program (device_env.sh puts /tmp/site/bin on PATH)
DEPENDENCIES = [
    "apache-tvm-ffi", "nvidia-ml-py", "ninja", "requests", "certifi", "charset-normalizer",
    "idna", "urllib3", "tqdm", "packaging",
]  # fmt: skip
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)


def python_closure(wheel: zipfile.ZipFile, names: set[str]) -> set[str]:
    """The flashinfer modules reachable by imports from its ``__init__`` (and parents)."""

    def module_file(mod: str) -> str | None:
        path = mod.replace(".", "/")
        return next((f for f in (path + ".py", path + "/__init__.py") if f in names), None)

    def package(f: str) -> str:
        mod = f[:-3].replace("/", ".")
        return (
            mod.removesuffix(".__init__") if mod.endswith(".__init__") else mod.rpartition(".")[0]
        )

    def imports(f: str) -> set[str]:
        try:
            tree = ast.parse(wheel.read(f).decode("utf-8", "replace"))
        except SyntaxError:
            return set()
        out, pkg = set(), package(f)
        for node in ast.walk(tree):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                mods = [base] + [f"{base}.{a.name}" for a in node.names]
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                name = node.args[0].value
                mods = [pkg + name if name.startswith(".") else name]
            for mod in mods:
                parts = mod.split(".")
                if parts[0] != "flashinfer":
                    continue
                for i in range(1, len(parts) + 1):
                    if (found := module_file(".".join(parts[:i]))) is not None:
                        out.add(found)
        return out

    todo = [
        "flashinfer/__init__.py",
        "flashinfer/prefill.py",
        "flashinfer/jit/attention/modules.py",
    ]
    seen: set[str] = set()
    while todo:
        f = todo.pop()
        if f not in seen:
            seen.add(f)
            todo.extend(imports(f) - seen)
    return seen


def csrc_closure(wheel: zipfile.ZipFile, names: set[str]) -> set[str]:
    """The batch-prefill sources and every csrc file they include (comments stripped)."""
    missing = [f for f in CSRC_SOURCES if CSRC + f not in names]
    if missing:
        raise SystemExit(f"flashinfer_bundle: the wheel lacks {missing}: its layout changed")
    todo, seen = [CSRC + f for f in CSRC_SOURCES], set()
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        text = wheel.read(f).decode("utf-8", "replace")
        text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
        text = re.sub(r"//[^\n]*", "", text)
        for kind, inc in INCLUDE.findall(text):
            dirs = ([posixpath.dirname(f) + "/"] if kind == '"' else []) + [CSRC, DATA + "include/"]
            for d in dirs:
                path = posixpath.normpath(d + inc)
                if path in names:
                    if path.startswith(CSRC):
                        todo.append(path)
                    break
    return seen


def kept(wheel: zipfile.ZipFile) -> list[str]:
    names = {n for n in wheel.namelist() if not n.endswith("/")}
    keep = python_closure(wheel, names) | csrc_closure(wheel, names)
    keep |= {n for n in ("flashinfer/py.typed", "flashinfer/_build_meta.py") if n in names}
    for n in names:
        top_header = n.startswith(CSRC) and "/" not in n[len(CSRC) :]
        if (
            any(n.startswith(t) for t in HEADER_TREES)
            or LICENSES.match(n)
            or DIST_INFO.match(n)
            or (top_header and n.endswith((".h", ".cuh", ".hpp", ".inc")))
        ):
            keep.add(n)
    return sorted(keep)


def write_tar(wheel: zipfile.ZipFile, names: list[str], out: Path) -> None:
    """A reproducible tar.xz (sorted names, no times or owners)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w:xz", preset=9) as tar:
        for name in names:
            data = wheel.read(name)
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))


def pip_download(args: list[str], dest: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
         "--python-version", "3.12", "--implementation", "cp", "--platform",
         "manylinux_2_28_x86_64", "--platform", "manylinux2014_x86_64", "-d", str(dest), *args],
        check=True,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", default="0.7.4")
    ap.add_argument("--wheel", help="a downloaded flashinfer-python wheel (default: download)")
    ap.add_argument("--out", default=str(ROOT / ".fi" / "flashinfer.tar.xz"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        wheel_path = args.wheel
        if wheel_path is None:
            pip_download([f"flashinfer-python=={args.version}"], Path(tmp))
            wheel_path = str(next(Path(tmp).glob("flashinfer_python-*.whl")))
        with zipfile.ZipFile(wheel_path) as wheel:
            names = kept(wheel)
            write_tar(wheel, names, Path(args.out))
    pip_download(DEPENDENCIES, ROOT / ".whl")
    size = Path(args.out).stat().st_size / 1e6
    print(f"{len(names)} files -> {args.out} ({size:.1f} MB); its imports -> .whl/")


if __name__ == "__main__":
    main()
