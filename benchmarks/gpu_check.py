"""``make gpu-check``: the project's GPU acceptance in one command and one table (issue 40).

Parts, each a subprocess under its own timeout (a failure is a row of the table, never the end):
1. the machine (GPU, CuPy, MPI, torch);
2. each CUDA kernel against its NumPy twin on the device (``gpu_kernels.py``: max relative error);
3. each strategy and control through ``hpctrain train`` on the GPU against the same run on the CPU
   (final losses within 1e-4 relative); ``ps-ssp`` (bounded staleness) is timing-dependent even on
   the CPU (two CPU runs differ), so the parameter server is compared in ``sync`` mode and ssp only
   has to finish with a finite loss;
4. the ``gpu`` tests at ``-n 1`` and ``-n 2``;
5. the GPT step at 85 M and 163 M, fp32 and bf16-mixed, eager and from a CUDA graph, against
   PyTorch eager fp32 and bf16 autocast when torch imports (``gpt_gpu.py``), with issue 40's
   targets: the step at most 1.00x PyTorch's time and at most 1.25x its peak memory (a row over
   either, or whose graph capture failed, makes this part not ok).

    python3 benchmarks/gpu_check.py [--quick] [--cpu] [--fail PART]

``--quick``: a subset (< 2 minutes on an H100); ``--cpu``: the same structure with tiny sizes on
the CPU (no GPU needed: proves the script end to end; the kernels and the GPT step take their GPU
code path on the tests' device stand-in with the kernels emulated, the capture included);
``--fail PART``: make that part fail on purpose
(the dry run's proof that a failing part is reported and the rest runs). Wheels in ``.whl/`` are
installed first (the GPU machine has no internet). Everything is also written to
``$OUT/gpu-check.log`` (and the table to ``$OUT/gpu-check.md``) when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import glob
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
G = ["--model", "gpt", "--max-samples", "320", "--epochs", "2"]
# (name, ranks, flags, compare): compare False = must finish with a finite loss (not deterministic)
JOBS = [
    ("mlp-dp", 2, [], True), ("gpt-1", 1, G, True), ("gpt-dp", 2, G, True),
    ("gpt-tp", 2, [*G, "--strategy", "tp"], True),
    ("gpt-pp-1f1b", 2, [*G, "--strategy", "pp"], True),
    ("gpt-pp-gpipe", 2, [*G, "--strategy", "pp", "--schedule", "gpipe"], True),
    ("gpt-tp2-pp2", 4, [*G, "--tp", "2", "--pp", "2"], True),
    ("gpt-zero1", 2, [*G, "--zero", "1"], True), ("gpt-zero2", 2, [*G, "--zero", "2"], True),
    ("gpt-zero3", 2, [*G, "--zero", "3"], True),
    ("gpt-bf16-mixed", 2, [*G, "--precision", "bf16-mixed"], True),
    ("gpt-fp16-mixed", 2, [*G, "--precision", "fp16-mixed"], True),
    ("gpt-recompute", 2, [*G, "--recompute"], True), ("gpt-accum", 2, [*G, "--accum-steps", "2"], True),
    ("gpt-dropout", 2, [*G, "--dropout", "0.1"], True),
    ("gpt-async-ckpt", 2, [*G, "--async-checkpoint", "--checkpoint-every", "2"], True),
    ("ps-sync", 2, ["--strategy", "ps", "--ps-mode", "sync"], True),
    ("ps-ssp", 2, ["--strategy", "ps", "--ps-mode", "ssp"], False),
    ("user-model-pp", 2, ["--model", "tests/user_model.py:build", "--max-samples", "256", "--pp", "2"], True),
]
QUICK_JOBS = {"gpt-1", "gpt-dp", "gpt-pp-1f1b", "gpt-zero3", "gpt-bf16-mixed", "ps-sync"}


class Check:
    def __init__(self, args: argparse.Namespace) -> None:
        self.a = args
        self.rows: list[tuple[str, str, str]] = []
        self.log_lines: list[str] = []
        self.t0 = time.time()
        self.out = os.environ.get("OUT")
        self.tmp = tempfile.mkdtemp(prefix="gpucheck-")
        self.env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                    "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "2", "HPCTRAIN_TIMEOUT": "120"}  # fmt: skip
        self.mpiexec = shutil.which("mpiexec", path=os.path.dirname(PY) + os.pathsep + os.environ["PATH"])

    def say(self, text: str) -> None:
        line = f"[{time.time() - self.t0:5.0f}s] {text}"
        print(line, flush=True)
        self.log_lines.append(line)

    def run(self, cmd: list[str], timeout: float, part: str) -> tuple[int, str]:
        """``cmd`` under ``timeout``; ``(exit code or 124, output)``; the output goes to the log."""
        if self.a.fail == part:
            cmd = [PY, "-c", f"import sys; print('deliberate failure of {part}'); sys.exit(3)"]
        elif self.a.fail == f"{part}:hang":  # the timeout's proof: a part that never ends
            cmd, timeout = [PY, "-c", "import time; time.sleep(600)"], 5
        try:
            p = subprocess.run(cmd, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)
            rc, text = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as exc:
            rc = 124
            text = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            text += f"\n(timed out after {timeout:.0f} s)"
        self.log_lines.append(f"$ {' '.join(cmd)}  -> exit {rc}\n{text}")
        return rc, text

    def row(self, part: str, result: str, detail: str) -> None:
        self.rows.append((part, result, detail))
        self.say(f"{part}: {result} {detail}")

    # -- the parts ---------------------------------------------------------------------------------
    def machine(self) -> None:
        probe = ("import numpy, mpi4py; from mpi4py import MPI; import hpctrain.backend as b; cp = b.cupy(); "
                 "print('numpy', numpy.__version__, '| mpi4py', mpi4py.__version__, '|', "
                 "MPI.Get_library_version().splitlines()[0]); "
                 "print('cupy', cp.__version__ if cp else None, "
                 "cp.cuda.runtime.getDeviceProperties(0)['name'].decode() if cp else 'no GPU')")
        rc, text = self.run([PY, "-c", probe], 60, "machine")
        self.row("machine", "ok" if rc == 0 else f"FAIL (exit {rc})", " / ".join(text.strip().splitlines()[-2:])[:200])

    def kernels(self) -> None:
        # the dry run takes the device branch on the CPU: the tests' stand-in with the kernels emulated
        rc, text = self.run([PY, "benchmarks/gpu_kernels.py", *(["--emulate"] if self.a.cpu else [])], 150, "kernels")
        cases = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
        for c in cases:
            name = f"kernel {c.get('case')} {c.get('dtype', '')}".strip()
            if "error" in c:
                self.row(name, "FAIL", c["error"])
            elif "skip" in c:
                self.row(name, "skip", c["skip"])
            else:
                worst = max(c["errors"].values())
                self.row(name, "ok" if c["ok"] else "DIFFER", f"max rel error {worst:.1e} (tol {c['tol']:.0e}): "
                         + ", ".join(f"{k} {v:.1e}" for k, v in c["errors"].items()))  # fmt: skip
        if rc != 0 and not cases:
            self.row("kernels", f"FAIL (exit {rc})", text.strip().splitlines()[-1][:200] if text.strip() else "")

    def _train(self, name: str, n: int, flags: list[str], device: str, extra: list[str] | None = None) -> dict:
        run_dir = os.path.join(self.tmp, f"{name}-{device}")
        cmd = [self.mpiexec, "-n", str(n), PY, "-m", "hpctrain", "train", "--log-every", "100000", "--run-dir",
               run_dir, "--device", device, *flags, *(extra or [])]
        rc, text = self.run(cmd, 150 if not self.a.cpu else 240, name)
        try:
            with open(os.path.join(run_dir, "summary.json")) as f:
                return {"rc": rc, **json.load(f)}
        except (OSError, ValueError):
            err = [ln for ln in text.splitlines() if "Error" in ln or "error:" in ln]
            return {"rc": rc, "error": (err[-1] if err else text.strip()[-160:])[:200]}

    def job(self, name: str, n: int, flags: list[str], compare: bool) -> tuple[str, str, str]:
        dev = "cpu" if self.a.cpu else "cuda"  # the dry run compares the CPU with itself
        cpu, gpu = self._train(name, n, flags, "cpu"), self._train(name, n, flags, dev)
        for side, r in (("cpu", cpu), (dev, gpu)):
            if "error" in r or r.get("final_loss") is None:
                return name, f"FAIL on {side} (exit {r['rc']})", r.get("error", "no final loss")
        a, b = float(cpu["final_loss"]), float(gpu["final_loss"])
        peak = (gpu.get("memory") or {}).get("device_pool_peak", 0) / 2**20
        mem = f", GPU pool peak {peak:,.0f} MiB" if peak else ""
        if not compare:
            ok = math.isfinite(a) and math.isfinite(b)
            return name, "ran" if ok else "FAIL", f"cpu {a:.6f}, {dev} {b:.6f} (not deterministic: not compared){mem}"
        ok = abs(a - b) <= 1e-4 * abs(a)
        return name, "ok" if ok else "DIFFER", f"cpu {a:.8f}, {dev} {b:.8f}{mem}"

    def crossing(self) -> tuple[str, str, str]:
        """A checkpoint written on the GPU resumed on the CPU equals a CPU run throughout."""
        dev = "cpu" if self.a.cpu else "cuda"
        ref = self._train("ckpt-ref", 1, G, "cpu")
        first = self._train("ckpt-cross", 1, [*G[:-1], "1", "--checkpoint-every", "1"], dev)
        second = self._train("ckpt-cross", 1, [*G, "--resume"], "cpu")
        for r in (ref, first, second):
            if "error" in r or r.get("final_loss") is None:
                return "checkpoint gpu->cpu", f"FAIL (exit {r['rc']})", r.get("error", "no final loss")
        a, b = float(ref["final_loss"]), float(second["final_loss"])
        ok = abs(a - b) <= 1e-4 * abs(a)
        return "checkpoint gpu->cpu", "ok" if ok else "DIFFER", f"cpu throughout {a:.8f}, {dev} then cpu {b:.8f}"

    def strategies(self) -> None:
        jobs = [j for j in JOBS if not self.a.quick or j[0] in QUICK_JOBS]
        with cf.ThreadPoolExecutor(2 if self.a.cpu else 4) as pool:
            futures = [pool.submit(self.job, *j) for j in jobs]
            futures.append(pool.submit(self.crossing))
            for f in futures:
                try:
                    self.row(*f.result())
                except Exception as exc:  # noqa: BLE001
                    self.row("strategy", "FAIL", f"{type(exc).__name__}: {exc}"[:200])

    def gpu_tests(self) -> None:
        marks = ["-m", "gpu"] if not self.a.cpu else ["-m", "gpu", "tests/test_gpu.py"]
        base = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", *marks] + ([] if self.a.cpu else ["tests"])
        for n in (1, 2):
            cmd = base if n == 1 else [self.mpiexec, "-n", "2", PY, "-m", "mpi4py", *base[1:], "--with-mpi"]
            rc, text = self.run(cmd, 200, f"gpu tests -n {n}")
            summary = [ln for ln in text.splitlines() if any(w in ln for w in (" passed", " failed", " error",
                                                                                   " skipped", " deselected"))]
            failed = [ln for ln in text.splitlines() if ln.startswith(("FAILED", "ERROR"))]
            self.row(f"gpu tests -n {n}", "ok" if rc in (0, 5) else f"FAIL (exit {rc})",
                     "; ".join((summary[-1:] or ["no summary"]) + failed[:4])[:300])

    def gpt(self) -> None:
        cmd = [PY, "benchmarks/gpt_gpu.py", *(["--emulate"] if self.a.cpu else []),
               *(["--quick"] if self.a.quick else [])]
        rc, text = self.run(cmd, 100 if self.a.quick else 170, "gpt")
        table = [ln for ln in text.splitlines() if ln.startswith(("|", "  ("))]
        rows = [t for t in table if t.startswith("| ") and " M " in t]
        over = [r.split("|")[1].strip() for r in rows if "OVER" in r]
        failed = [r.split("|")[1].strip() for r in rows if "capture failed" in r]
        result = f"FAIL (exit {rc})" if rc != 0 else ("OVER target" if over or failed else "ok")
        detail = f"{len(rows)} rows below" + (f"; over a target (time <= 1.00x, memory <= 1.25x PyTorch): "
                                              f"{', '.join(over)}" if over else "")
        detail += f"; graph capture failed: {', '.join(failed)}" if failed else ""
        self.row("GPT step vs PyTorch", result, detail)
        self.gpt_table = table

    def finish(self) -> int:
        lines = ["\n| part | result | detail |", "|---|---|---|"]
        lines += [f"| {p} | {r} | {d} |" for p, r, d in self.rows]
        lines += ["", *getattr(self, "gpt_table", [])]
        table = "\n".join(lines)
        print(table, flush=True)
        bad = [p for p, r, _ in self.rows if r not in ("ok", "ran", "skip")]
        self.say(f"end: {len(self.rows) - len(bad)} ok, {len(bad)} not ok" + (f" ({', '.join(bad)})" if bad else ""))
        if self.out:
            os.makedirs(self.out, exist_ok=True)
            with open(os.path.join(self.out, "gpu-check.log"), "w") as f:
                f.write("\n".join(self.log_lines) + "\n" + table + "\n")
            with open(os.path.join(self.out, "gpu-check.md"), "w") as f:
                f.write(table + "\n")
        return 1 if bad else 0


def install_wheels() -> None:
    """The wheels the GPU machine lacks (no internet there), from ``.whl/``: always when there are
    any (the image's mpi4py may have no MPI library beside it, and pytest-mpi is not there)."""
    wheels = sorted(glob.glob(os.path.join(ROOT, ".whl", "*.whl")))
    if wheels:
        subprocess.run([PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", *wheels],
                       timeout=120, check=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cpu", action="store_true", help="dry run on NumPy: no GPU needed")
    ap.add_argument("--fail", default=None, help="make this part fail on purpose (machine, kernels, a job name, "
                                                 "'gpu tests -n 1', gpt)")
    a = ap.parse_args()
    install_wheels()
    c = Check(a)
    if not a.cpu:
        rc, text = c.run([PY, "-c", "import hpctrain.backend as b, sys; sys.exit(0 if b.cupy() else 1)"], 60, "probe")
        if rc != 0:
            print("gpu-check: SKIP: no usable GPU here (CuPy does not import or sees no device); "
                  "`make gpu-check CPU=1` runs the dry run", flush=True)
            return 0
    for part in (c.machine, c.kernels, c.strategies, c.gpu_tests, c.gpt):
        c.say(f"-- {part.__name__}")
        try:
            part()
        except Exception as exc:  # noqa: BLE001 - one part's crash is a row, the rest runs
            c.row(part.__name__, "FAIL", f"{type(exc).__name__}: {exc}"[:200])
    return c.finish()


if __name__ == "__main__":
    sys.exit(main())
