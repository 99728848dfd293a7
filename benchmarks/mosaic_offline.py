"""Compile Mosaic GPU kernels for sm_90a on a machine without a GPU: ptxas' registers and spills, shared memory, PTX.

    python benchmarks/mosaic_offline.py fetch            # once: jax's CUDA plugin wheels for this jax + nvdisasm
    python benchmarks/mosaic_offline.py selftest         # compiles a one-line kernel, prints its resources
    PYTHONPATH=. python benchmarks/indexer_fp4_resources.py --offline DIR
    PYTHONPATH=. python benchmarks/mosaic_resources.py DIR --offline

Why: GPU time is scarce (sessions 49 and 50 had none), and the questions a kernel change raises first -- does it fit
in 128 registers, does it spill, how much shared memory, how many CTAs an SM -- are ptxas' answers, not the GPU's.

How. `jit(f).trace(...).lower(lowering_platforms=("cuda",))` runs Pallas' Mosaic GPU lowering on the CPU and leaves
each kernel's serialized MLIR module in `mosaic.gpu.core.KNOWN_KERNELS`. jax's CUDA plugin (`xla_cuda_plugin.so`
of the `jax-cuda13-pjrt` wheel) exports `MosaicGpuCompile(module, size)`, which runs the rest of the pipeline:
Mosaic GPU's MLIR passes, LLVM's NVPTX backend, ptxas (from `cuda_root`), a host-side JIT, then cuModuleLoadData.
The driver calls it makes are answered by `offline_cuda/fakecuda.c` (built here with gcc as libcuda.so.1 and loaded
first): compute capability 9.0, and the cubin it is handed is written to disk. The plugin's own dump switches
(`MOSAIC_GPU_DUMP_PTXAS`, `..._PTX`, `..._TO`) then write ptxas' verbose log and the PTX.

Two quirks of jax 0.10.2's plugin, handled here: MosaicGpuCompile asks for the SM version before it registers
LLVM's NVPTX target (fixed upstream later), so `mosaic::gpu::EnsureLLVMNVPTXTargetIsRegistered` -- not exported --
is called first at its address from the plugin's symbol table (`nm`); and the host-side JIT needs
`libmosaic_gpu_runtime.so` loaded globally.

SASS: with an nvdisasm (`nvdisasm=`, $NVDISASM, PATH, beside ptxas, or the `nvidia-cuda-nvdisasm` wheel `fetch`
unpacks) the plugin also writes each kernel's SASS with its control codes (`.sass_ctrl`); without one it prints "nvdisasm
invocation failed" and carries on.

What the numbers are: this machine's jax (0.10.x) lowering and its ptxas (`ptxas --version` is printed); the
device runs jax 0.11.2 with its own ptxas, so a register count here can differ by a few from the device's. Use it
to rank variants and to catch spills, and confirm a decision on the GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
FAKE_CUDA_SOURCE = os.path.join(HERE, "offline_cuda", "fakecuda.c")

# An H100/H200 SM: 64K 32-bit registers (allocated per warp in units of 256), 228 KB of shared memory of which
# 1 KB is reserved per CTA, at most 64 warps and 32 CTAs.
SM_REGISTERS = 65536
SM_SHARED_BYTES = 233472
CTA_RESERVED_SHARED_BYTES = 1024
SM_MAX_WARPS = 64
SM_MAX_CTAS = 32


def cache_dir() -> str:
    import jax

    root = os.environ.get("DSV4_MOSAIC_OFFLINE_DIR", os.path.expanduser("~/.cache/dsv4_jax/mosaic_offline"))
    return os.path.join(root, f"jax-{jax.__version__}")


def plugin_paths(root: str | None = None) -> tuple[str, str]:
    """(xla_cuda_plugin.so, libmosaic_gpu_runtime.so) of the fetched wheels; a clear error when missing."""
    root = root or cache_dir()
    plugin = os.path.join(root, "jax_plugins", "xla_cuda13", "xla_cuda_plugin.so")
    runtime = os.path.join(root, "jax_cuda13_plugin", "libmosaic_gpu_runtime.so")
    missing = [p for p in (plugin, runtime) if not os.path.isfile(p)]
    if missing:
        raise FileNotFoundError(f"{', '.join(missing)} not found: run `python benchmarks/mosaic_offline.py fetch` "
                                "(downloads jax-cuda13-plugin and jax-cuda13-pjrt for this jax version)")
    return plugin, runtime


def fetch(root: str | None = None) -> str:
    """Downloads and unpacks the two wheels matching the installed jax into `root` (pip prints its progress)."""
    import jax

    root = root or cache_dir()
    os.makedirs(root, exist_ok=True)
    wheels = os.path.join(root, "wheels")
    # nvdisasm (5 MB) for the SASS dumps `benchmarks/sass_loops.py` reads
    specs = [f"jax-cuda13-plugin=={jax.__version__}", f"jax-cuda13-pjrt=={jax.__version__}", "nvidia-cuda-nvdisasm>=13"]
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--dest", wheels, *specs], check=True)
    for wheel in sorted(glob.glob(os.path.join(wheels, "*.whl"))):
        with zipfile.ZipFile(wheel) as z:
            wanted = [n for n in z.namelist()
                      if n.endswith(("xla_cuda_plugin.so", "libmosaic_gpu_runtime.so", "bin/nvdisasm"))]
            for name in wanted:
                path = z.extract(name, root)
                if name.endswith("nvdisasm"):
                    os.chmod(path, 0o755)
                print(f"unpacked {name}")
    plugin_paths(root)
    return root


def cached_nvdisasm(root: str | None = None) -> str | None:
    """The nvdisasm that `fetch` unpacked, if any."""
    found = sorted(glob.glob(os.path.join(root or cache_dir(), "nvidia", "*", "bin", "nvdisasm")))
    return found[-1] if found else None


def default_cuda_root() -> str:
    """A directory with bin/ptxas: $DSV4_CUDA_ROOT if set, else jax's own choice (importing Mosaic GPU sets
    $MOSAIC_GPU_CUDA_ROOT -- overwriting it -- to the nvidia-cuda-nvcc wheel where one is installed, else
    /usr/local/cuda), else the parent of `ptxas` on PATH."""
    root = os.environ.get("DSV4_CUDA_ROOT")
    if root:
        return root
    import jax.experimental.mosaic.gpu  # noqa: F401  (sets MOSAIC_GPU_CUDA_ROOT as it would on a GPU machine)

    root = os.environ.get("MOSAIC_GPU_CUDA_ROOT")
    if root and os.path.isfile(os.path.join(root, "bin", "ptxas")):
        return root
    ptxas = shutil.which("ptxas")
    if not ptxas:
        raise FileNotFoundError("no ptxas: set DSV4_CUDA_ROOT (a dir with bin/ptxas) or put CUDA's bin on PATH")
    return os.path.dirname(os.path.dirname(os.path.realpath(ptxas)))


def _symbol_offsets(library: str, names: dict[str, str]) -> dict[str, int]:
    """Offsets of symbols in `library`'s symbol table, by demangled name (`nm -C`)."""
    if not shutil.which("nm"):
        raise FileNotFoundError("`nm` (binutils) is needed to find the plugin's unexported symbols")
    out = subprocess.run(["nm", "-C", library], check=True, capture_output=True, text=True).stdout
    found = {}
    for line in out.splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3:
            for key, name in names.items():
                if parts[2] == name:
                    found[key] = int(parts[0], 16)
    missing = set(names) - set(found)
    if missing:
        raise RuntimeError(f"symbols {sorted(names[k] for k in missing)} not in {library}")
    return found


@dataclasses.dataclass
class KernelResources:
    """What ptxas and the launch attributes say about one compiled kernel."""

    name: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    threads: int                # threads a CTA (the PTX's .maxntid / .reqntid)
    shared_bytes: int           # dynamic shared memory the launch asks for
    setmaxnreg: tuple           # warp-specialized kernels: the per-warpgroup register budgets the PTX sets
    ptxas_log: str
    ptx_path: str | None
    cubin_path: str | None
    sass_path: str | None       # nvdisasm's SASS with control codes, where an nvdisasm was found

    @property
    def ctas_per_sm(self) -> int:
        """CTAs an SM holds by registers, shared memory, warps and the CTA cap (not by barriers or clusters)."""
        warps = -(-self.threads // 32)
        regs_per_warp = -(-self.registers * 32 // 256) * 256
        by_regs = SM_REGISTERS // max(1, warps * regs_per_warp)
        by_smem = SM_SHARED_BYTES // (self.shared_bytes + CTA_RESERVED_SHARED_BYTES)
        return min(by_regs, by_smem, SM_MAX_WARPS // warps, SM_MAX_CTAS)

    @property
    def wgmma_serialized(self) -> list[str]:
        """ptxas' "Potential Performance Loss: wgmma.mma_async instructions are serialized ..." notes (C7514-C7520):
        ptxas then waits for every wgmma where it is issued, so no score chain or P.V overlaps anything. Session 72
        met C7514 from accumulators left in flight across a loop's back edge; a timing would only show a slowdown."""
        return re.findall(r"\((C75\d\d)\) Potential Performance Loss: wgmma", self.ptxas_log)

    def line(self) -> str:
        budgets = f" (setmaxnreg {'/'.join(map(str, self.setmaxnreg))})" if self.setmaxnreg else ""
        notes = self.wgmma_serialized
        serial = f", wgmma serialized ({', '.join(notes)})" if notes else ""
        return (f"{self.name}: {self.registers} registers{budgets}, {self.threads} threads, spills "
                f"{self.spill_stores} B stored / {self.spill_loads} B loaded, stack {self.stack_bytes} B, shared "
                f"memory {self.shared_bytes} B -> {self.ctas_per_sm} CTA(s) an SM{serial}")


def parse_ptxas_log(text: str) -> dict:
    """Registers, spills and stack of the (single) entry in a `ptxas -v` log."""
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    entry = re.search(r"Compiling entry function '([^']+)'", text)
    if not (regs and spill and entry):
        raise ValueError(f"not a ptxas -v log of one entry:\n{text}")
    return dict(name=entry.group(1), registers=int(regs.group(1)), stack_bytes=int(spill.group(1)),
                spill_stores=int(spill.group(2)), spill_loads=int(spill.group(3)))


def ptx_setmaxnreg(ptx: str) -> tuple:
    """The register budgets `setmaxnreg.{inc,dec}` sets, in PTX order ("dec 56", "inc 224" -> (56, 224))."""
    return tuple(int(v) for v in re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx))


def ptx_threads(ptx: str) -> int:
    m = re.search(r"\.(?:maxntid|reqntid)\s+(\d+)\s*,\s*(\d+)\s*,\s*(\d+)", ptx)
    if not m:
        raise ValueError("the PTX declares no .maxntid/.reqntid")
    return int(m.group(1)) * int(m.group(2)) * int(m.group(3))


class OfflineMosaic:
    """Compiles serialized Mosaic GPU modules with jax's CUDA plugin against the stand-in driver.

    One instance a process (the plugin and the stand-in driver stay loaded); `compile_module` returns the kernel's
    resources and leaves its ptxas log, PTX and cubin under `out_dir/<prefix>*`.
    """

    _MOSAIC_COMPILE = "MosaicGpuCompile"
    _ENSURE_NVPTX = "mosaic::gpu::EnsureLLVMNVPTXTargetIsRegistered()"

    def __init__(self, out_dir: str, cuda_root: str | None = None, plugin_root: str | None = None,
                 compute_capability: str = "90", nvdisasm: str | None = None):
        plugin, runtime = plugin_paths(plugin_root)
        self.out_dir = out_dir
        os.makedirs(out_dir, exist_ok=True)
        source_root = cuda_root or default_cuda_root()
        ptxas = os.path.join(source_root, "bin", "ptxas")
        if not os.path.isfile(ptxas):
            raise FileNotFoundError(f"{ptxas} does not exist (cuda_root={source_root})")
        self.ptxas_version = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout.strip()
        build = tempfile.mkdtemp(prefix="fakecuda_")
        # the plugin runs <root>/bin/ptxas, and <root>/bin/nvdisasm for the SASS dump (<kernel>.sass_ctrl: SASS with
        # its control codes); a root of links puts both where it looks
        self.cuda_root = os.path.join(build, "cuda")
        os.makedirs(os.path.join(self.cuda_root, "bin"))
        os.symlink(os.path.realpath(ptxas), os.path.join(self.cuda_root, "bin", "ptxas"))
        nvdisasm = (nvdisasm or os.environ.get("NVDISASM") or shutil.which("nvdisasm")
                    or next(iter(glob.glob(os.path.join(source_root, "bin", "nvdisasm"))), None)
                    or cached_nvdisasm(plugin_root))
        self.nvdisasm = nvdisasm if nvdisasm and os.path.isfile(nvdisasm) else None
        if self.nvdisasm:
            os.symlink(os.path.realpath(self.nvdisasm), os.path.join(self.cuda_root, "bin", "nvdisasm"))
        self.compute_capability = compute_capability
        fake = os.path.join(build, "libcuda.so.1")
        subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-Wl,-soname,libcuda.so.1", "-o", fake, FAKE_CUDA_SOURCE,
                        "-ldl"], check=True)
        # loaded globally under the soname libcuda.so.1 before the plugin: the plugin's dlopen finds this one
        self._fake = ctypes.CDLL(fake, mode=ctypes.RTLD_GLOBAL)
        self._runtime = ctypes.CDLL(runtime, mode=ctypes.RTLD_GLOBAL)
        self._plugin = ctypes.CDLL(plugin, mode=ctypes.RTLD_GLOBAL)
        compile_fn = self._plugin.MosaicGpuCompile
        compile_fn.argtypes = [ctypes.c_char_p, ctypes.c_int]
        compile_fn.restype = ctypes.POINTER(ctypes.c_void_p)
        self._compile = compile_fn
        unload = self._plugin.MosaicGpuUnload
        unload.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        unload.restype = None
        self._unload = unload
        offsets = _symbol_offsets(plugin, {"compile": self._MOSAIC_COMPILE, "ensure": self._ENSURE_NVPTX})
        base = ctypes.cast(compile_fn, ctypes.c_void_p).value - offsets["compile"]
        ctypes.CFUNCTYPE(None)(base + offsets["ensure"])()
        self._count = 0

    def compile_module(self, module_asm: bytes, prefix: str | None = None, keep_mlir: bool = False
                       ) -> KernelResources:
        prefix = prefix or f"m{self._count:03d}_"
        self._count += 1
        work = tempfile.mkdtemp(prefix="mosaic_offline_")
        env = dict(MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_TO=work,
                   MOSAIC_GPU_CUDA_ROOT=self.cuda_root, FAKE_CUDA_DUMP_DIR=work,
                   FAKE_CUDA_CC=self.compute_capability)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            handle = self._compile(module_asm, len(module_asm))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        logs = sorted(glob.glob(os.path.join(work, "*.ptxas")))
        if not handle:
            detail = "".join(open(p, errors="replace").read() for p in logs)
            raise RuntimeError(f"MosaicGpuCompile failed (ptxas log: {detail or 'none written'}); rerun with "
                               "FAKE_CUDA_TRACE=1 for the driver calls")
        self._unload(handle)
        if len(logs) != 1:
            raise RuntimeError(f"expected one ptxas log in {work}, found {logs}")
        info = parse_ptxas_log(open(logs[0]).read())
        moved = {}
        for path in sorted(glob.glob(os.path.join(work, "*"))):
            base = os.path.basename(path)
            if base.endswith(".mlir-passes.log") and not keep_mlir:   # MBs a kernel; rarely wanted
                continue
            if base.endswith(".cubin"):
                base = info["name"] + ".cubin"
            dest = os.path.join(self.out_dir, prefix + base)
            shutil.move(path, dest)
            moved[os.path.basename(path)] = dest
        shutil.rmtree(work, ignore_errors=True)
        log_text = open(moved[os.path.basename(logs[0])]).read()
        ptx_path = next((p for n, p in moved.items() if n.endswith(".ptx") and not n.startswith("module_")), None)
        cubin = next((p for n, p in moved.items() if n.endswith(".cubin")), None)
        sass = next((p for n, p in moved.items() if n.endswith(".sass_ctrl")), None)
        ptx = open(ptx_path).read() if ptx_path else ""
        threads = ptx_threads(ptx) if ptx else 0
        shared = 0
        attrs = moved.get("func_attributes.txt")
        if attrs:
            for line in open(attrs):
                attr, value = map(int, line.split())
                if attr == 8:  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                    shared = value
        return KernelResources(threads=threads, shared_bytes=shared, setmaxnreg=ptx_setmaxnreg(ptx),
                               ptxas_log=log_text, ptx_path=ptx_path, cubin_path=cubin, sass_path=sass, **info)

    def compile_jitted(self, fn, *args, **kwargs) -> list[KernelResources]:
        """Lowers jit(fn)(*args) for CUDA and compiles every Mosaic GPU kernel it contains."""
        import jax
        from jax.experimental.mosaic.gpu import core as mgpu_core

        mgpu_core.KNOWN_KERNELS.clear()   # the lowering adds each kernel of this program (a cache; safe to clear)
        jax.jit(fn).trace(*args, **kwargs).lower(lowering_platforms=("cuda",))
        modules = list(mgpu_core.KNOWN_KERNELS.values())
        if not modules:
            raise RuntimeError("the program has no Mosaic GPU kernel")
        return [self.compile_module(m) for m in modules]


def _selftest(out_dir: str) -> None:
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0 + 1.0

    fn = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((128, 128), jnp.float32),
                        compiler_params=plgpu.CompilerParams())
    compiler = OfflineMosaic(out_dir)
    print(compiler.ptxas_version.splitlines()[-1])
    for r in compiler.compile_jitted(fn, jax.ShapeDtypeStruct((128, 128), jnp.float32)):
        print(r.line())
        print(f"   PTX {r.ptx_path}, cubin {r.cubin_path}, SASS {r.sass_path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=("fetch", "selftest"))
    ap.add_argument("--out", default=None, help="where selftest leaves its files (default: a temporary dir)")
    a = ap.parse_args()
    if a.command == "fetch":
        print(f"plugin wheels in {fetch()}")
    else:
        _selftest(a.out or tempfile.mkdtemp(prefix="mosaic_offline_selftest_"))


if __name__ == "__main__":
    main()
