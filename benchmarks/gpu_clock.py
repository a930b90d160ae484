"""The GPU's clock, power and throttle reasons while something is timed, read from `nvidia-smi`.

A kernel's time on a given GPU moves with its SM clock, and the clock moves with power, temperature
and idle gaps: two runs of the same build, or of an unchanged kernel in two builds, can differ by a
few per cent for that reason alone. The timing harness records what the GPU reported during each
measurement, so that a difference between two runs can be checked against the clock before it is
read as a difference between builds.

  * `ClockLog`: a context manager that keeps the samples nvidia-smi took (every few milliseconds, one
    background process for the whole run: `Sampler`) while its block ran; `.summary()` is the busy
    samples' SM clock (median, min), the highest power draw and the throttle reasons seen, or None
    where nvidia-smi is not there.
  * `gpu_facts()`: the GPU's UUID (which physical GPU a run had), power limit, highest SM clock and
    driver, for the run's metadata.

Both are silent no-ops without `nvidia-smi` (a CPU machine): the numbers they would add are simply
absent.
"""

from __future__ import annotations

import atexit
import os
import shutil
import statistics
import subprocess
import threading
import time

# NVML's clock-event ("throttle") reason bits, as `nvidia-smi --query-gpu=clocks_throttle_reasons.active`
# prints them (a hexadecimal mask).
IDLE = 0x1
REASONS = {
    0x1: "idle",
    0x2: "applications clocks setting",
    0x4: "software power cap",
    0x8: "hardware slowdown",
    0x10: "sync boost",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake",
    0x100: "display clock setting",
}
SAMPLE_FIELDS = "clocks.sm,power.draw,clocks_throttle_reasons.active"
FACT_FIELDS = ("uuid", "power.limit", "clocks.max.sm", "driver_version")
FIRST_SAMPLE_TIMEOUT_S = 5.0
INTERVAL_MS = 20  # between samples: several within a profiled run of the shortest case


def gpu_index() -> str:
    """nvidia-smi's id for the GPU the process uses first: the first CUDA_VISIBLE_DEVICES entry (an
    index or a UUID), else 0."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return visible or "0"


def reason_names(mask: int) -> list[str]:
    """The names of the reason bits set in `mask`, in bit order (unknown bits as hex)."""
    names = [name for bit, name in REASONS.items() if mask & bit]
    unknown = mask & ~sum(REASONS)
    return names + ([f"0x{unknown:x}"] if unknown else [])


def parse_sample(line: str) -> tuple[float, float | None, int] | None:
    """One `clocks.sm, power.draw, reasons` line (csv, noheader, nounits) as (MHz, W or None, mask);
    None for a line that is not one (a header, an error, "[N/A]" clocks)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 3:
        return None
    try:
        mhz = float(parts[0])
        mask = int(parts[2], 16)
    except ValueError:
        return None
    try:
        watts = float(parts[1])
    except ValueError:
        watts = None
    return mhz, watts, mask


def summarize(lines: list[str]) -> dict | None:
    """The samples' summary: `samples` (all parsed), `busy_samples` (those without the idle bit),
    `sm_mhz_median` / `sm_mhz_min` over the busy samples (None if none), `power_w_max` (all samples)
    and `reasons` (every reason other than idle seen in a busy sample). None when no line parses."""
    samples = [s for s in map(parse_sample, lines) if s is not None]
    if not samples:
        return None
    busy = [s for s in samples if not s[2] & IDLE]
    clocks = [mhz for mhz, _, _ in busy]
    watts = [w for _, w, _ in samples if w is not None]
    mask = 0
    for _, _, m in busy:
        mask |= m
    return dict(samples=len(samples), busy_samples=len(busy),
                sm_mhz_median=statistics.median(clocks) if clocks else None,
                sm_mhz_min=min(clocks) if clocks else None,
                power_w_max=max(watts) if watts else None,
                reasons=reason_names(mask))


class Sampler:
    """One nvidia-smi process sampling every `interval_ms` for as long as the sampler runs, each line
    kept with the time it was read (time.monotonic). Started on first use and stopped at exit, so a
    run of many measurements pays nvidia-smi's start-up (up to seconds) once. `running` is False
    without nvidia-smi or when it printed nothing within FIRST_SAMPLE_TIMEOUT_S."""

    def __init__(self, smi: str, interval_ms: int):
        self.interval_ms = interval_ms
        self.samples: list[tuple[float, str]] = []
        self._first = threading.Event()
        command = [smi, f"--id={gpu_index()}", f"--query-gpu={SAMPLE_FIELDS}", "--format=csv,noheader,nounits",
                   f"--loop-ms={interval_ms}"]
        try:
            self._proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self._proc = None
            return
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._first.wait(FIRST_SAMPLE_TIMEOUT_S)
        atexit.register(self.stop)

    def _read(self):
        for line in self._proc.stdout:
            self.samples.append((time.monotonic(), line.strip()))
            self._first.set()
        self._first.set()  # the process ended (or failed) before any sample: no need to wait on

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None and bool(self.samples)

    def between(self, start: float, end: float) -> list[str]:
        return [line for when, line in list(self.samples) if start <= when <= end]

    def stop(self):
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


_samplers: dict[tuple[str, int], Sampler] = {}


def sampler(smi: str, interval_ms: int) -> Sampler:
    """The process's sampler for this nvidia-smi and interval (started, or restarted if it died)."""
    key = (smi, interval_ms)
    current = _samplers.get(key)
    if current is None or not current.running:
        if current is not None:
            current.stop()
        current = _samplers[key] = Sampler(smi, interval_ms)
    return current


class ClockLog:
    """`with ClockLog() as log: work()`, then `log.summary()`: the samples of the process's nvidia-smi
    sampler (every `interval_ms`) from the block's start to one interval after its end. Without
    nvidia-smi, or if it prints no sample, the block just runs and the summary is None."""

    def __init__(self, interval_ms: int = INTERVAL_MS, smi: str | None = None):
        self.interval_ms = interval_ms
        self.smi = smi if smi is not None else shutil.which("nvidia-smi")
        self.lines: list[str] = []
        self._sampler = None
        self._start = 0.0

    def __enter__(self):
        if self.smi:
            self._sampler = sampler(self.smi, self.interval_ms)
        self._start = time.monotonic()
        return self

    def __exit__(self, *exc):
        if self._sampler is not None and self._sampler.running:
            time.sleep(self.interval_ms / 1000)  # the sample that closes the block
            self.lines = self._sampler.between(self._start, time.monotonic())
        return False

    def summary(self) -> dict | None:
        return summarize(self.lines)


def gpu_facts(smi: str | None = None) -> dict | None:
    """`uuid`, `power_limit_w`, `max_sm_mhz`, `driver` of the GPU (`gpu_index()`), or None without
    nvidia-smi or when it fails."""
    smi = smi if smi is not None else shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run([smi, f"--id={gpu_index()}", f"--query-gpu={','.join(FACT_FIELDS)}",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    parts = [p.strip() for p in out.stdout.strip().splitlines()[0].split(",")] if out.stdout.strip() else []
    if out.returncode != 0 or len(parts) != len(FACT_FIELDS):
        return None

    def number(text):
        try:
            return float(text)
        except ValueError:
            return None

    return dict(uuid=parts[0], power_limit_w=number(parts[1]), max_sm_mhz=number(parts[2]), driver=parts[3])
