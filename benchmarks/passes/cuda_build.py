"""What a CUDA build of the package costs, estimated on a machine with nvcc and no GPU.

    nice -n 19 python -m benchmarks.passes cuda-build [--fork DIR] [--reuse] [--json out.json]

The device check (.ci/device-check) builds the package with CUDA on a machine with 16
cores, in a time limit that also has to hold the tests. This script tells what that
build costs without building it:

1. configures two CUDA build trees of the patched fork with CMake alone (cheap): the fork's
   defaults (`-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90`) and the device check's trimmed
   options (the `DEVICE_CMAKE_ARGS=` line of .ci/device-check);
2. lists the CUDA translation units each compiles (from compile_commands.json), by kind:
   template instances of flash attention (mma, wmma, vec), of the quantized matrix products
   (mmq) and matrix-vector products (mmvq), and the other .cu files;
3. compiles a sample of each kind with the build's own command line, one at a time, and
   measures its CPU time (user + sys of nvcc and everything it runs: cicc, ptxas, the host
   compiler), which other load on the machine distorts far less than wall time;
4. extrapolates: CPU seconds per kind (count x mean of the kind's samples; the heavy .cu files
   are measured one by one), plus the C++ part (--cxx-core-seconds, from the CPU build: ~20
   core-minutes for llama-server + _core + rpc-server), and the wall time on --cores cores at
   --efficiency: max(total / (cores x efficiency), longest unit) + --serial-seconds (configure,
   patching the base tree, linking) + the time to deflate the CUDA objects into the wheel on
   one core (scaled from the samples' objects: the compression mode trades compile time for it).

Options that change the C++ side (GGML_IQK_FA_ALL_QUANTS: the CPU flash-attention kernels for
quantized KV caches) are measured on the iqk/fa sources in both trees, and the difference is
taken off the C++ part.

Needs cuBLAS's headers (the .cu files include cublas_v2.h): found in the CUDA toolkit, in the
Python package nvidia-cublas (nvidia/cu13), or under --cublas-root / $CUBLAS_ROOT (a folder
with include/cublas_v2.h, e.g. the nvidia/cu13 folder of the unpacked nvidia-cublas wheel).
Nothing is linked; library paths CMake insists on point at placeholders.

--reuse keeps the samples of an earlier run's JSON (same file, same command line) and measures
only what is missing, so a rerun after a change of the sample list is cheap.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

from benchmarks.harness import RESULTS, ROOT as REPO, write_result

DEVICE_CHECK = REPO / ".ci" / "device-check"
DEFAULT_JSON = RESULTS / "passes" / "cuda_build_cost.json"
BASE_ARGS = ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90", "-DLLAMA_BUILD_SERVER=ON",
             "-DCMAKE_BUILD_TYPE=Release", "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON", "-DGGML_CCACHE=OFF"]

# The kinds of CUDA translation unit, by path (first match wins).
KINDS = [
    ("fattn-mma inst", "template-instances/fattn-mma"),
    ("fattn-wmma inst", "template-instances/fattn-wmma"),
    ("fattn-vec inst", "template-instances/fattn-vec"),
    ("mmq inst", "template-instances/mmq-instance"),
    ("mmvq inst", "template-instances/mmvq-instance"),
    ("other .cu", ""),
]
# The other .cu files that are measured one by one (the large ones); the rest of that kind is
# estimated from OTHER_SAMPLE.
HEAVY = ["ggml-cuda.cu", "ggml-cuda/fattn-new-mma.cu", "ggml-cuda/fattn.cu", "ggml-cuda/mmq_id.cu",
         "ggml-cuda/iqk_mmvq.cu"]
OTHER_SAMPLE = ["ggml-cuda/acc.cu", "ggml-cuda/rope.cu", "ggml-cuda/convert.cu", "ggml-cuda/fattn-tile-f16.cu"]
SAMPLES = {
    "fattn-mma inst": ["fattn-mma-f16-instance-ncols1_8-ncols2_4.cu", "fattn-mma-f16-instance-ncols1_64-ncols2_1.cu"],
    "fattn-wmma inst": ["fattn-wmma-f16-instance-kqhalf-cpb16.cu"],
    "fattn-vec inst": ["fattn-vec-f16-instance-hs128-q8_0-q8_0.cu", "fattn-vec-f32-instance-hs128-f16-f16.cu"],
    "mmq inst": ["mmq-instance-q4_0.cu", "mmq-instance-q4_k_id.cu", "mmq-instance-iq4_k_r4.cu"],
    "mmvq inst": ["mmvq-instance-q4_K.cu", "mmvq-instance-iq4_ks.cu"],
}
# C++ sources whose cost the trimmed options change (measured in both trees).
CXX_SAMPLE = ["iqk/fa/iqk_fa_128_128.cpp", "iqk/fa/iqk_fa_576_512.cpp"]
CXX_GLOB = "iqk/fa/"


def device_check_args() -> list[str]:
    """The trimmed CMake options: the DEVICE_CMAKE_ARGS="..." line of .ci/device-check."""
    m = re.search(r'^DEVICE_CMAKE_ARGS="([^"]*)"', DEVICE_CHECK.read_text(), re.MULTILINE)
    if not m:
        sys.exit(f"no DEVICE_CMAKE_ARGS=\"...\" line in {DEVICE_CHECK}")
    return m.group(1).split()


def find_cublas(root: str | None) -> Path | None:
    """The folder that holds cublas_v2.h, or None."""
    candidates = []
    if root:
        candidates.append(Path(root))
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            candidates.append(Path(os.environ[env]))
    candidates.append(Path("/usr/local/cuda"))
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent)
    try:
        import nvidia  # the namespace package of nvidia-cublas and friends

        candidates += [Path(p) / "cu13" for p in nvidia.__path__]
    except ImportError:
        pass
    for c in candidates:
        for inc in (c / "include", c / "targets" / "x86_64-linux" / "include"):
            if (inc / "cublas_v2.h").is_file():
                return inc
    return None


CUBLAS_HINT = ("cublas_v2.h not found: pass --cublas-root or set CUBLAS_ROOT (e.g. the nvidia/cu13 folder "
               "of `pip download --no-deps nvidia-cublas==13.0.0.19`, unpacked)")


def configure(fork: Path, build: Path, extra: list[str], cublas_inc: Path) -> list[dict]:
    # CMake wants these libraries to exist; nothing is linked here, so any file will do.
    placeholder = next(Path("/usr/local/cuda/lib64").glob("libcudart.so*"), None) or Path(sys.executable)
    args = BASE_ARGS + extra + [f"-DIKDFLASH_SOURCE_DIR={REPO}", f"-DCMAKE_CUDA_FLAGS=-I{cublas_inc}"]
    for lib in ("cublas", "cublasLt", "cuda_driver"):
        args.append(f"-DCUDA_{lib}_LIBRARY={placeholder}")
    stamp = build / "ikdflash-args.txt"
    if not (stamp.is_file() and stamp.read_text() == "\n".join(args) and (build / "compile_commands.json").is_file()):
        shutil.rmtree(build, ignore_errors=True)
        r = subprocess.run(["cmake", "-S", str(fork), "-B", str(build), "-G", "Ninja", *args],
                           capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise RuntimeError(f"configure failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        stamp.write_text("\n".join(args))
    return json.loads((build / "compile_commands.json").read_text())


def rel(entry: dict, fork: Path) -> str:
    return os.path.relpath(entry["file"], fork / "ggml" / "src")


def kind_of(path: str) -> str:
    return next(k for k, pat in KINDS if pat in path)


def command_key(entry: dict) -> str:
    """The compile command without its output path, hashed: samples are reused only for an
    identical command line."""
    cmd = re.sub(r"\s-o\s+\S+", " ", entry["command"])
    return hashlib.sha256(cmd.encode()).hexdigest()[:16]


def compile_once(entry: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "unit.o"
        argv = shlex.split(entry["command"])
        argv[argv.index("-o") + 1] = str(out)
        log = Path(tmp) / "log"
        start = time.perf_counter()
        with log.open("wb") as sink:  # a file, not a pipe: warnings would fill a pipe nobody reads yet
            proc = subprocess.Popen(argv, cwd=entry["directory"], stdout=sink, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(proc.pid, 0)  # the rusage of nvcc and all it ran
        wall = time.perf_counter() - start
        if os.waitstatus_to_exitcode(status) != 0:
            raise RuntimeError(f"compile failed ({entry['file']}):\n{log.read_text(errors='replace')[-3000:]}")
        size = out.stat().st_size
        t0 = time.process_time()
        packed = len(zlib.compress(out.read_bytes(), 6))  # what a wheel's deflate would make of it
        zip_s = time.process_time() - t0
    return {"cpu_s": round(usage.ru_utime + usage.ru_stime, 2), "wall_s": round(wall, 2),
            "obj_bytes": size, "deflated_bytes": packed, "deflate_s": round(zip_s, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fork", type=Path, default=Path(os.environ.get("IKDFLASH_FORK", "~/src/ikdflash-fork")).expanduser(),
                        help="the patched fork's source tree (default ~/src/ikdflash-fork, or $IKDFLASH_FORK)")
    parser.add_argument("--build-root", type=Path, default=Path(tempfile.gettempdir()) / "ikdflash-cuda-cost",
                        help="where the two build trees are configured (nothing is built there)")
    parser.add_argument("--cublas-root", default=os.environ.get("CUBLAS_ROOT"))
    parser.add_argument("--cores", type=int, default=16)
    parser.add_argument("--efficiency", type=float, default=0.9)
    parser.add_argument("--cxx-core-seconds", type=float, default=1200.0,
                        help="CPU seconds of the C++ part with the fork's defaults (the CPU build's)")
    parser.add_argument("--cxx-longest-seconds", type=float, default=35.0,
                        help="the longest C++ unit (unicode-data.cpp, ~33 s on this machine)")
    parser.add_argument("--serial-seconds", type=float, default=60.0,
                        help="what does not run in parallel: configure, patching, links, the wheel")
    parser.add_argument("--keep-mmvq", default="q4_0,q4_1,q8_0,q4_k,q5_k,q6_k,iq4_xs",
                        help="also estimate the device check with mmvq instances of these types only (as its "
                             "GGML_CUDA_MMQ_TYPES does for mmq); empty: no such estimate")
    parser.add_argument("--reuse", action="store_true", help="keep the samples of --json's earlier run")
    parser.add_argument("--list", action="store_true", help="list the translation units and stop")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args()

    inc = find_cublas(args.cublas_root)
    if inc is None:
        sys.exit(CUBLAS_HINT)
    trimmed_args = device_check_args()
    configs = {"default": [], "device-check": [a for a in trimmed_args if a.split("=")[0] not in
                                               ("-DGGML_CUDA", "-DCMAKE_CUDA_ARCHITECTURES")]}
    trees = {name: configure(args.fork, args.build_root / name, extra, inc) for name, extra in configs.items()}

    units: dict[str, dict[str, dict]] = {}  # config -> relpath -> entry
    for name, cc in trees.items():
        units[name] = {rel(e, args.fork): e for e in cc if e["file"].endswith(".cu")}
        units[name].update({rel(e, args.fork): e for e in cc if CXX_GLOB in e["file"] and e["file"].endswith(".cpp")})

    if args.list:
        for name, u in units.items():
            print(f"== {name}: {sum(p.endswith('.cu') for p in u)} CUDA units")
            for p in sorted(u):
                print(f"  {kind_of(p) if p.endswith('.cu') else 'C++ iqk/fa':16s} {p}")
        return

    earlier = {}
    if args.reuse and args.json.is_file():
        earlier = {(s["file"], s["command_key"]): s for s in json.loads(args.json.read_text()).get("samples", [])}

    # What to compile: every sample in the default tree, and in the trimmed tree where its
    # command line differs (an option that changes flags or defines).
    wanted: list[tuple[str, str]] = []
    for name in trees:
        u = units[name]
        for p in u:
            base = os.path.basename(p)
            k = kind_of(p) if p.endswith(".cu") else None
            if (k and base in SAMPLES.get(k, [])) or p in HEAVY or p in OTHER_SAMPLE or p in CXX_SAMPLE:
                wanted.append((name, p))
    samples: dict[tuple[str, str], dict] = {}
    measured: dict[str, dict] = {}  # command_key -> result
    for name, p in sorted(wanted, key=lambda w: (w[0] != "default", w[1])):
        entry = units[name][p]
        key = command_key(entry)
        if key in measured:
            samples[(name, p)] = measured[key]
            continue
        if (p, key) in earlier:
            result = earlier[(p, key)]
            print(f"  {name:12s} {p:60s} {result['cpu_s']:8.1f} s CPU (earlier run)", flush=True)
        else:
            result = {"file": p, "command_key": key, **compile_once(entry)}
            print(f"  {name:12s} {p:60s} {result['cpu_s']:8.1f} s CPU  {result['wall_s']:7.1f} s wall  "
                  f"{result['obj_bytes'] / 1e6:6.1f} MB", flush=True)
        result["kind"] = kind_of(p) if p.endswith(".cu") else "C++ iqk/fa"
        measured[key] = samples[(name, p)] = result
        # kept as it goes: a run cut short leaves its samples to --reuse
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_result(args.json, {"partial": True, "samples": list(measured.values())}, threads=os.cpu_count() or 1)

    nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, check=True).stdout
    report = {"nvcc": nvcc.strip().splitlines()[-1],
              "machine": {"cpus": os.cpu_count(), "load_avg": os.getloadavg()},
              "configs": {n: BASE_ARGS[:2] + e for n, e in configs.items()},
              "assumptions": {k: getattr(args, k) for k in ("cores", "efficiency", "cxx_core_seconds",
                                                            "cxx_longest_seconds", "serial_seconds")},
              "samples": list(measured.values()), "estimates": {}}
    def estimate(tree: str, u: list[str]) -> dict:
        """The cost of building the units u, from the samples of tree's command lines."""
        rows = []
        total = 0.0
        longest = args.cxx_longest_seconds
        obj_bytes = 0.0
        for k, _ in KINDS:
            paths = [p for p in u if p.endswith(".cu") and kind_of(p) == k]
            if k == "other .cu":
                heavy = [p for p in paths if p in HEAVY]
                rest = [p for p in paths if p not in HEAVY]
                heavy_s = sum(samples[(tree, p)]["cpu_s"] for p in heavy)
                rest_samples = [samples[(tree, p)] for p in rest if (tree, p) in samples]
                mean = statistics.mean(s["cpu_s"] for s in rest_samples)
                longest = max([longest] + [samples[(tree, p)]["cpu_s"] for p in heavy])
                obj_bytes += sum(samples[(tree, p)]["obj_bytes"] for p in heavy) + \
                    statistics.mean(s["obj_bytes"] for s in rest_samples) * len(rest)
                rows.append({"kind": "other .cu (heavy, each)", "units": len(heavy), "sampled": len(heavy),
                             "mean_cpu_s": heavy_s / max(1, len(heavy)), "cpu_s": heavy_s})
                rows.append({"kind": "other .cu (rest)", "units": len(rest), "sampled": len(rest_samples),
                             "mean_cpu_s": mean, "cpu_s": mean * len(rest)})
                total += heavy_s + mean * len(rest)
                continue
            if not paths:
                rows.append({"kind": k, "units": 0, "sampled": 0, "mean_cpu_s": 0.0, "cpu_s": 0.0})
                continue
            # the kind's samples in this tree (all of them, also where u leaves a sampled unit out)
            ks = [sm for (n, p), sm in samples.items() if n == tree and p.endswith(".cu") and kind_of(p) == k]
            mean = statistics.mean(sm["cpu_s"] for sm in ks)
            longest = max([longest] + [sm["cpu_s"] for sm in ks])
            obj_bytes += statistics.mean(sm["obj_bytes"] for sm in ks) * len(paths)
            rows.append({"kind": k, "units": len(paths), "sampled": len(ks), "mean_cpu_s": mean,
                         "cpu_s": mean * len(paths)})
            total += mean * len(paths)
        # the C++ part: the CPU build's, less what the trimmed options save on iqk/fa
        cxx = args.cxx_core_seconds
        fa_units = [p for p in u if CXX_GLOB in p]
        if tree != "default":
            d = [samples[("default", p)]["cpu_s"] - samples[(tree, p)]["cpu_s"] for p in CXX_SAMPLE
                 if (tree, p) in samples and ("default", p) in samples]
            if d:
                cxx -= statistics.mean(d) * len(fa_units)
        rows.append({"kind": "C++ (CPU build's)", "units": None, "sampled": None, "mean_cpu_s": None, "cpu_s": cxx})
        all_cpu = total + cxx
        parallel = all_cpu / (args.cores * args.efficiency)
        # the wheel is deflated on one core: its CUDA objects' share, scaled from the samples
        rated = [sm for (n, p), sm in samples.items()
                 if n == tree and p.endswith(".cu") and sm.get("deflate_s") is not None]
        deflate = obj_bytes * statistics.mean(sm["deflate_s"] / sm["obj_bytes"] for sm in rated)
        wall = max(parallel, longest) + args.serial_seconds + deflate
        return {"cuda_units": sum(1 for p in u if p.endswith(".cu")),
                "counts": {k: sum(1 for p in u if p.endswith(".cu") and kind_of(p) == k) for k, _ in KINDS},
                "rows": rows, "cuda_cpu_s": total, "cxx_cpu_s": cxx, "total_cpu_s": all_cpu,
                "longest_unit_s": longest, "wheel_deflate_s": deflate, "wall_s": wall,
                "cuda_objects_mb": obj_bytes / 1e6}

    for name in trees:
        report["estimates"][name] = estimate(name, list(units[name]))
    # What a type filter for the matrix-vector kernels would leave too (MMQ has one since patch
    # `cuda-GGML_CUDA_MMQ_TYPES-builds-only-the-listed-MMQ-`, GGML_CUDA_MMQ_TYPES; MMVQ has none: it would take another patch).
    keep = {q.strip().lower() for q in args.keep_mmvq.split(",") if q.strip()}
    if keep:
        def kept(p: str) -> bool:
            m = re.search(r"/mmvq-instance-(\w+)\.cu$", p)
            return m is None or m.group(1).lower() in keep
        hypothetical = f"device-check + MMVQ types {','.join(sorted(keep))} (no such option)"
        report["configs"][hypothetical] = report["configs"]["device-check"] + [f"(keep {','.join(sorted(keep))})"]
        report["estimates"][hypothetical] = estimate("device-check", [p for p in units["device-check"] if kept(p)])

    for name, est in report["estimates"].items():
        print(f"\n== {name}: {est['cuda_units']} CUDA units ({' '.join(report['configs'][name])})")
        print(f"  {'kind':26s} {'units':>5s} {'sampled':>7s} {'CPU s/unit':>10s} {'CPU s':>8s}")
        for r in est["rows"]:
            units_s = "" if r["units"] is None else str(r["units"])
            sampled = "" if r["sampled"] is None else str(r["sampled"])
            mean = "" if r["mean_cpu_s"] is None else f"{r['mean_cpu_s']:.1f}"
            print(f"  {r['kind']:26s} {units_s:>5s} {sampled:>7s} {mean:>10s} {r['cpu_s']:8.0f}")
        print(f"  total {est['total_cpu_s']:.0f} CPU s (CUDA {est['cuda_cpu_s']:.0f}, C++ {est['cxx_cpu_s']:.0f}); "
              f"longest unit {est['longest_unit_s']:.0f} s; CUDA objects ~{est['cuda_objects_mb']:.0f} MB")
        print(f"  on {args.cores} cores at {args.efficiency:.0%}: max({est['total_cpu_s']:.0f} / "
              f"{args.cores * args.efficiency:.1f}, {est['longest_unit_s']:.0f}) + {args.serial_seconds:.0f} "
              f"+ {est['wheel_deflate_s']:.0f} (deflating the wheel) = "
              f"{est['wall_s']:.0f} s ({est['wall_s'] / 60:.1f} min)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.json, report, threads=os.cpu_count() or 1)
    print(f"\nwrote {args.json}")
