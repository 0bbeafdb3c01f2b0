"""Shared output for the benchmarks: a rich table on stdout, the figures as JSON."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table


def machine() -> dict:
    """CPU model, cores, the ISA flags that matter to torch's CPU kernels, torch and its threads, when (UTC)."""
    model, flags = platform.processor() or platform.machine(), set()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16") if f in flags]
    return {"cpu": model, "cores": os.cpu_count(), "isa": isa, "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def cpu_line(m: dict) -> str:
    """`machine()`'s CPU model, cores and ISA flags, for a bench's first line."""
    return f"{m['cpu']}, {m['cores']} cores, ISA {' '.join(m['isa']) or '-'}"


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of `fn` over `repeats` runs."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def print_table(title: str, columns: list[str], rows: list[list[object]]) -> None:
    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="right" if c != columns[0] else "left")
    for r in rows:
        table.add_row(*[f"{v:,.2f}" if isinstance(v, float) else str(v) for v in r])
    Console().print(table)


def write_json(path: Path | None, figures: dict) -> None:
    if path is not None:
        path.write_text(json.dumps({"machine": machine(), **figures}, indent=2))
        Console().print(f"figures written to {path}")
