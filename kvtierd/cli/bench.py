"""`kvtierd bench ...` subcommands."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from kvtierd.bench.report import machine, print_table, write_json

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks: tables on stdout, figures with --json.")

JsonOpt = Annotated[Optional[Path], typer.Option("--json", help="Write the figures to this JSON file.")]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


@bench_app.command("engine")
def bench_engine(
    batches: Annotated[str, typer.Option(help="Decode batch sizes.")] = "1,8,32",
    prefill: Annotated[str, typer.Option(help="Prefill prompt lengths.")] = "512,2048",
    model: Annotated[Optional[str], typer.Option()] = None,
    json_path: JsonOpt = None,
) -> None:
    """Decode and prefill tokens/s beside transformers' generate, memory bandwidth, step overhead."""
    from kvtierd.bench.engine_bench import run_engine_bench
    from kvtierd.model.loader import load_model

    figures = run_engine_bench(load_model(model), _ints(batches), _ints(prefill))
    m = machine()
    typer.echo(f"machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['torch_threads']} threads), {m['date']}")
    typer.echo(
        f"memory read bandwidth: {figures['memory_read_GB_s']:.2f} GB/s; "
        f"weights read per batch-1 token: {figures['weight_bytes_per_token'] / 1e6:.1f} MB"
    )
    print_table(
        "decode (float32, greedy, EOS ignored)",
        ["batch", "kvtierd tok/s", "transformers tok/s", "ratio", "step overhead ms", "weight GB/s", "share of mem bw"],
        [
            [r["batch"], r["kvtierd_tok_s"], r["transformers_tok_s"], r["speedup"], r["step_overhead_ms"],
             r.get("weight_GB_s", "-"), r.get("share_of_mem_bw", "-")]
            for r in figures["decode"]
        ],
    )
    print_table(
        "prefill (one request)",
        ["tokens", "kvtierd tok/s", "transformers tok/s", "ratio"],
        [[r["tokens"], r["kvtierd_tok_s"], r["transformers_tok_s"], r["speedup"]] for r in figures["prefill"]],
    )
    typer.echo(f"engine overhead per step at 64 running sequences: {figures['step_overhead_ms_at_64']:.2f} ms (median)")
    write_json(json_path, figures)


@bench_app.command("capacity")
def bench_capacity(
    budget_tokens: Annotated[int, typer.Option(help="KV budget in token slots.")] = 262_144,
    block_sizes: Annotated[str, typer.Option(help="Page sizes to compare.")] = "1,16,256",
    seed: Annotated[int, typer.Option()] = 0,
    json_path: JsonOpt = None,
) -> None:
    """Sequences that fit a fixed KV budget, paged vs contiguous max-length reservations."""
    from kvtierd.bench.capacity_bench import run_capacity_bench

    figures = run_capacity_bench(budget_tokens, _ints(block_sizes), seed)
    typer.echo(
        f"budget {figures['budget_tokens']:,} token slots; length mix 20-4,000 tokens, "
        f"mean {figures['mean_length']:.0f}, median {figures['median_length']}"
    )
    print_table(
        "capacity",
        ["block size", "paged seqs", "contiguous seqs", "ratio", "paged unused", "contiguous unused"],
        [
            [r["block_size"], r["paged_seqs"], r["contiguous_seqs"], r["ratio"],
             f"{r['paged_unused_share']:.2%}", f"{r['contiguous_unused_share']:.2%}"]
            for r in figures["rows"]
        ],
    )
    write_json(json_path, figures)


@bench_app.command("serve")
def bench_serve(
    socket: Annotated[Optional[Path], typer.Option(help="Bench the daemon on this socket; default: start one.")] = None,
    clients: Annotated[str, typer.Option(help="Concurrent clients, one table row each.")] = "1,8,32",
    requests_per_client: Annotated[int, typer.Option(help="Streamed requests each client sends in turn.")] = 2,
    max_tokens: Annotated[int, typer.Option(help="max_tokens of every request.")] = 32,
    seed: Annotated[int, typer.Option()] = 0,
    json_path: JsonOpt = None,
) -> None:
    """TTFT, inter-token latency and throughput of concurrent streaming chat clients over the socket."""
    from kvtierd.bench.serve_bench import ServeBenchError, run_serve_bench

    try:
        figures = run_serve_bench(socket, _ints(clients), requests_per_client, max_tokens, seed)
    except ServeBenchError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    m = machine()
    typer.echo(f"machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['torch_threads']} threads), {m['date']}")
    typer.echo(f"daemon: {figures['daemon']}; model {figures['model']}")
    typer.echo(
        f"streamed chat, temperature 0, max_tokens {max_tokens}, EOS not ignored (long-story prompts); "
        "every request has its own prompt: they share only the chat template's system prefix"
    )
    levels = figures["levels"]

    def ms(v: float | None) -> str:  # whole ms keep eight columns inside an 80-column terminal
        return "-" if v is None else f"{v:,.0f}"

    print_table(
        "serve: concurrent streaming clients (tok/s: output tokens of all clients)",
        ["clients", "requests", "TTFT p50 ms", "TTFT p95 ms", "ITL p50 ms", "ITL p95 ms", "tok/s", "req/s"],
        [
            [r["clients"], r["requests"], ms(r["ttft_ms_p50"]), ms(r["ttft_ms_p95"]), ms(r["itl_ms_p50"]),
             ms(r["itl_ms_p95"]), f"{r['output_tok_s']:,.1f}", f"{r['req_s']:.2f}"]
            for r in levels
        ],
    )
    typer.echo(
        f"requests that reached max_tokens: {sum(r['reached_max_tokens'] for r in levels)}"
        f"/{sum(r['requests'] for r in levels)}; prompt tokens served from the prefix cache: "
        f"{sum(r['cached_prompt_tokens'] for r in levels)}"
    )
    write_json(json_path, figures)
