"""`kvtierd bench ...` subcommands."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Optional, TypeVar

import typer

from kvtierd.bench.report import cpu_line, machine, print_table, write_json

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks: tables on stdout, figures with --json.")

JsonOpt = Annotated[Optional[Path], typer.Option("--json", help="Write the figures to this JSON file.")]
# The daemon leaves torch its default thread count (one per core it may use): a bench compares like with like.
ThreadsOpt = Annotated[int, typer.Option(help="torch threads; 0: the daemon's (torch's default).")]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


T = TypeVar("T")


def _figures(run: Callable[[], T]) -> T:
    """A bench's figures; a bench that cannot run here (no kernel, no Redis) says why and exits 2."""
    try:
        return run()
    except RuntimeError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e


@bench_app.command("engine")
def bench_engine(
    batches: Annotated[str, typer.Option(help="Decode batch sizes.")] = "1,8,32",
    prefill: Annotated[str, typer.Option(help="Prefill prompt lengths.")] = "512,2048",
    modes: Annotated[str, typer.Option(help="Weight modes beside float32 (float32 is always measured).")] = "auto",
    threads: Annotated[int, typer.Option(help="Threads for every side (0: torch's default, as the daemon).")] = 0,
    model: Annotated[Optional[str], typer.Option()] = None,
    json_path: JsonOpt = None,
) -> None:
    """Decode and prefill tokens/s of each weight mode beside transformers and llama.cpp, warm-turn TTFT."""
    import torch

    from kvtierd.bench.engine_bench import run_engine_bench
    from kvtierd.model.loader import load_model
    from kvtierd.model.weight_modes import default_weight_mode

    threads = threads or torch.get_num_threads()
    mode_list = [default_weight_mode(torch.device("cpu")).name if m == "auto" else m for m in modes.split(",") if m]
    f = run_engine_bench(load_model(model, dtype="float32"), _ints(batches), _ints(prefill), mode_list, threads)
    m = machine()
    typer.echo(f"machine: {f['cpu']}, {m['cores']} cores, torch {m['torch']}, {f['threads']} threads on every side "
               f"(the daemon's default), {m['date']}")  # f['cpu'] names the ISA flags already
    typer.echo(f"llama.cpp: {'llama-cpp-python, same GGUF' if f['llama_cpp'] else 'not installed (no column)'}; "
               f"memory read bandwidth: {f['memory_read_GB_s']:.2f} GB/s; weights read per batch-1 token: "
               + ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in f["weight_bytes_per_token"].items()))

    def opt(v):
        return "-" if v is None else v

    print_table(
        "decode (greedy, EOS ignored)",
        ["mode", "batch", "tok/s", "x float32", "transformers tok/s", "x transformers", "llama.cpp tok/s",
         "x llama.cpp", "step overhead ms", "weight GB/s", "share of mem bw"],
        [[r["mode"], r["batch"], r["kvtierd_tok_s"], r["vs_float32"], r["transformers_tok_s"], r["vs_transformers"],
          opt(r["llama_cpp_tok_s"]), opt(r["vs_llama_cpp"]), r["step_overhead_ms"], r.get("weight_GB_s", "-"),
          r.get("share_of_mem_bw", "-")] for r in f["decode"]],
    )
    print_table(
        "prefill (one request, alternating rounds)",
        ["side", "tokens", "tok/s", "x float32 (median of rounds)"],
        [[r["side"], r["tokens"], r["tok_s"], r["vs_float32"]] for r in f["prefill"]],
    )
    print_table("warm chat turn: 35 new tokens over a cached 1,500-token history (TTFT ms, median)",
                ["mode", "a session's turn (context pool)", "the prefix index (whole pages: 47 computed)"],
                [[r["mode"], r["session_ttft_ms"], r["prefix_ttft_ms"]] for r in f["warm_turn"]])
    typer.echo(f"engine overhead per step at 64 running sequences: {f['step_overhead_ms_at_64']:.2f} ms (median)")
    write_json(json_path, f)


@bench_app.command("quality")
def bench_quality(
    modes: Annotated[str, typer.Option(help="Weight modes to compare with float32.")] = "bfloat16,int8,int4",
    model: Annotated[Optional[str], typer.Option()] = None,
    json_path: JsonOpt = None,
) -> None:
    """Each weight mode against float32: teacher-forced top-1 agreement and KL, greedy chat replies."""
    from dataclasses import asdict

    from kvtierd.bench.quality_bench import CHATS, REPLY_TOKENS, greedy_replies, measure_quality
    from kvtierd.model.loader import convert_loaded, load_model

    reference = load_model(model, dtype="float32")
    replies = greedy_replies(reference)
    rows = [measure_quality(reference, convert_loaded(reference, mode), replies) for mode in modes.split(",") if mode]
    m = machine()
    typer.echo(f"machine: {cpu_line(m)}, torch {m['torch']}, {m['date']}; gate for the default "
               f"mode: top-1 >= 98%, mean KL <= 0.02 nats")
    print_table(
        f"weight modes against float32 ({len(CHATS)} greedy chats of {REPLY_TOKENS} tokens)",
        ["mode", "top-1 agreement", "mean KL nats/token", "identical replies", "reply tokens before divergence"],
        [[q.mode, f"{q.top1_agreement:.2%}", f"{q.mean_kl_nats:.4f}", f"{q.identical_replies}/{len(CHATS)}",
          f"{q.reply_token_agreement:.1%}"] for q in rows],
    )
    write_json(json_path, {"modes": [asdict(q) for q in rows]})


@bench_app.command("capacity")
def bench_capacity(
    budget_tokens: Annotated[int, typer.Option(help="KV budget in token slots.")] = 65_536,
    window: Annotated[int, typer.Option(help="Context window: the longest prompt + output.")] = 4096,
    block_size: Annotated[int, typer.Option(help="Paged: tokens per page.")] = 16,
    arrivals: Annotated[float, typer.Option(help="Requests arriving per decode step (Poisson).")] = 0.5,
    steps: Annotated[int, typer.Option(help="Decode steps simulated.")] = 3000,
    warmup: Annotated[int, typer.Option(help="Steps not measured while the budget fills.")] = 500,
    seed: Annotated[int, typer.Option()] = 0,
    json_path: JsonOpt = None,
) -> None:
    """Requests arriving, growing token by token and finishing: paged vs full-window slots vs exact-size first fit."""
    from dataclasses import asdict

    from kvtierd.bench.capacity_bench import CapacityWorkload, run_capacity_bench

    try:
        w = CapacityWorkload(budget_tokens, window, block_size, arrivals, steps, warmup, seed)
        f = run_capacity_bench(w)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    typer.echo(
        f"budget {w.budget_tokens:,} token slots, window {w.window:,}; {f.requests} requests over {w.steps:,} decode "
        f"steps ({w.arrivals_per_step:g} a step, seed {w.seed}), the first {w.warmup_steps} not measured; prompt "
        f"mean {f.prompt_mean:.0f}, median {f.prompt_p50}, max {f.prompt_max}; output mean {f.output_mean:.0f}, "
        f"median {f.output_p50}, max {f.output_max}"
    )
    print_table(
        "capacity under churn (shares of the budget, mean over the measured steps)",
        ["layout", "done", "running", "wait", "held", "wasted", "frag", "preempt", "recomp"],
        [[r.allocator, r.completed, f"{r.running_mean:.1f}", f"{r.queue_wait_p50_steps:.0f}", f"{r.held_share:.1%}",
          f"{r.wasted_share:.1%}", f"{r.fragmented_share:.1%}", r.preemptions, r.recomputed_tokens] for r in f.rows],
    )
    typer.echo(
        "paged 16: the real KVCacheManager, pages of 16 tokens; full window: a whole-window slot per sequence "
        "(llama.cpp slots, a static cache); first fit: one contiguous range of exactly the final length, first fit. "
        "done: requests finished; running: mean concurrent sequences; wait: median steps from arrival to admission; "
        "held: slots holding a token; wasted: taken but holding none (a page's tail; a window slot's rest; a range's "
        "tokens still to come); frag: free, but in holes too small for the waiting request; preempt: sequences "
        "evicted to make room; recomp: their tokens, computed again"
    )
    write_json(json_path, asdict(f))


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
    typer.echo(f"machine: {cpu_line(m)}, torch {m['torch']} ({m['torch_threads']} threads), {m['date']}")
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


@bench_app.command("chat")
def bench_chat(
    sessions: Annotated[int, typer.Option(help="Conversations, each opened with a document of its own.")] = 3,
    turns: Annotated[int, typer.Option(help="Turns per conversation (the first carries the document).")] = 3,
    doc_tokens: Annotated[str, typer.Option(help="Each document's tokens: low,high (drawn, seeded).")] = "1000,3000",
    max_tokens: Annotated[int, typer.Option(help="max_tokens of every reply.")] = 32,
    peer: Annotated[Optional[str], typer.Option(help="llamacpp: the same conversations on llama-cpp-python, "
                                                     "when it is importable.")] = None,
    socket: Annotated[Optional[Path], typer.Option(help="Bench the daemon on this socket (a tenant of its own per "
                                                   "run: root or the admin group); default: start one per run.")] = None,
    threads: ThreadsOpt = 0,
    seed: Annotated[int, typer.Option()] = 0,
    json_path: JsonOpt = None,
) -> None:
    """Interleaved multi-turn chats over long documents through the socket (official openai client): full history
    vs stored sessions, and llama.cpp with --peer llamacpp."""
    import os
    from dataclasses import asdict

    import torch

    from kvtierd.bench.chat_bench import ChatWorkload, run_chat_bench
    from kvtierd.bench.serve_bench import ServeBenchError
    from kvtierd.model.bundled import bundled_gguf_path
    from kvtierd.model.loader import load_model

    docs = _ints(doc_tokens)
    if peer not in (None, "llamacpp"):
        raise typer.BadParameter("--peer takes llamacpp")
    try:
        w = ChatWorkload(sessions, turns, (docs[0], docs[-1]), max_tokens, seed)
    except (ValueError, IndexError) as e:
        raise typer.BadParameter(str(e) or "--doc-tokens takes low,high") from e
    if threads > 0:
        torch.set_num_threads(threads)  # llama.cpp's
        os.environ["OMP_NUM_THREADS"] = str(threads)  # and torch's in the daemons the bench starts
    tok = load_model(None).tokenizer  # the bundled model, as the daemons the bench starts serve
    try:
        f = run_chat_bench(tok, w, torch.get_num_threads(), socket, peer, bundled_gguf_path())
    except ServeBenchError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    m = machine()
    typer.echo(f"machine: {cpu_line(m)}, torch {m['torch']} ({f.threads} threads; llama.cpp the "
               f"same), {m['date']}")
    typer.echo(f"{w.sessions} conversations x {w.turns} turns, interleaved, one request at a time; documents of "
               f"{', '.join(f'{n:,}' for n in f.doc_tokens)} tokens; replies of up to {w.max_tokens} tokens, "
               "temperature 0, streamed")

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:,.0f}"

    print_table(
        "chat: TTFT of first turns (the document) and later turns, ITL, wall time",
        ["system", "1st p50", "1st p95", "later p50", "later p95", "ITL p50", "ITL p95", "wall s", "cached"],
        [[r.system, ms(r.first_ttft_p50_ms), ms(r.first_ttft_p95_ms), ms(r.later_ttft_p50_ms),
          ms(r.later_ttft_p95_ms), ms(r.itl_p50_ms), ms(r.itl_p95_ms), f"{r.wall_s:.1f}",
          "-" if r.cached_share is None else f"{r.cached_share:.0%}"] for r in f.runs],
    )
    same = ", ".join(f"{name} {'yes' if ok else 'no'}" for name, ok in f.same_replies.items())
    typer.echo(f"times in ms; cached: prompt tokens served from the cache, as the daemon reports them (llama.cpp's "
               f"stream reports none). Replies equal to the first run's: {same}"
               + (f"; llama.cpp: skipped ({f.peer_skipped})" if f.peer_skipped else ""))
    write_json(json_path, asdict(f))


@bench_app.command("kernels")
def bench_kernels(
    dtype: Annotated[str, typer.Option(help="float16 or bfloat16.")] = "float16",
    batches: Annotated[str, typer.Option(help="Decode batch sizes.")] = "1,8,32",
    contexts: Annotated[str, typer.Option(help="Decode context lengths.")] = "512,4096,16384",
    head_dim: Annotated[int, typer.Option()] = 128,
    block_size: Annotated[int, typer.Option()] = 16,
    json_path: JsonOpt = None,
) -> None:
    """CUDA paged attention vs the torch reference (gather + SDPA), beside the device's copy bandwidth (GPU only)."""
    import torch

    from kvtierd.bench.kernels import run_kernel_bench

    if dtype not in ("float16", "bfloat16"):
        raise typer.BadParameter("--dtype is float16 or bfloat16")
    figures = _figures(lambda: run_kernel_bench(_ints(batches), _ints(contexts), head_dim=head_dim,
                                                block_size=block_size, dtype=getattr(torch, dtype),
                                                print_fn=typer.echo))
    m = machine()
    typer.echo(f"machine: {m['cpu']}, {figures['device']}, torch {m['torch']}, {m['date']}")
    print_table(
        f"decode attention ({figures['dtype']}; copy bandwidth {figures['copy_gbps']:.0f} GB/s)",
        ["ctx", "batch", "split", "kernel ms", "GB/s", "of copy", "reference ms", "speedup"],
        [[r["context_len"], r["batch_size"], r["num_partitions"], r["kernel_ms"], r["kernel_gbps"],
          f"{r['share_of_copy_bandwidth']:.0%}", r["reference_ms"], r["speedup"]] for r in figures["decode"]],
    )
    print_table("prefill attention (one sequence, causal)", ["ctx", "new tokens", "kernel ms", "reference ms", "speedup"],
                [[r["context_len"], r["query_len"], r["kernel_ms"], r["reference_ms"], r["speedup"]]
                 for r in figures["prefill"]])
    typer.echo("target on H100/H200: decode at long contexts >= 60% of copy bandwidth and faster than the reference")
    write_json(json_path, {"machine": m, **figures})


@bench_app.command("cpu-attention")
def bench_cpu_attention(
    contexts: Annotated[str, typer.Option(help="Context lengths.")] = "512,2560,8192",
    batches: Annotated[str, typer.Option(help="Decode batch sizes.")] = "1,4",
    threads: ThreadsOpt = 0,
    json_path: JsonOpt = None,
) -> None:
    """Decode attention on the CPU over the bundled model's 30 layers of scattered pages: the C decode kernel
    beside the prefill kernel (one token) and the torch reference; and short runs of new tokens through the
    prefill kernel, its keys in segments beside one item a KV head."""
    import torch

    from kvtierd.bench.cpu_attention_bench import run_cpu_attention_bench

    if threads:
        torch.set_num_threads(threads)
    f = _figures(lambda: run_cpu_attention_bench(tuple(_ints(contexts)), tuple(_ints(batches))))
    m = machine()
    typer.echo(f"machine: {cpu_line(m)}, torch {m['torch']} ({f['threads']} threads), {m['date']}")
    print_table(
        f"decode attention over {f['num_layers']} layers ({f['num_heads']} heads, {f['num_kv_heads']} KV heads of "
        f"{f['head_dim']}, bfloat16; ms a step; read bandwidth {f['read_gbps']:.1f} GB/s)",
        ["ctx", "batch", "KV MB", "decode kernel", "GB/s", "1-token prefill kernel", "reference"],
        [[r["context_len"], r["batch_size"], r["kv_mb"], r["decode_ms"], r["decode_gbps"],
          "-" if r["prefill_kernel_ms"] is None else r["prefill_kernel_ms"], r["reference_ms"]] for r in f["rows"]],
    )
    j = f["join"]
    typer.echo(f"a {j['context_len']:,}-token context's last token joining decodes over "
               f"{', '.join(map(str, j['decode_lens']))} tokens: {j['one_call_ms']:.2f} ms in their call, "
               f"{j['own_call_ms']:.2f} ms in a call of its own after theirs (ms a step, median)")
    if f["runs"]:
        print_table(
            f"runs of new tokens at the end of a long context through the prefill kernel (ms over {f['num_layers']} "
            "layers, median)",
            ["ctx", "new tokens", "keys in segments", "one item a KV head", "x"],
            [[r["context_len"], r["num_tokens"], r["segments_ms"], r["whole_ms"], r["whole_ms"] / r["segments_ms"]]
             for r in f["runs"]],
        )
    write_json(json_path, {"machine": m, **f})


@bench_app.command("join")
def bench_join(
    context: Annotated[int, typer.Option(help="Tokens of the cached prompt that joins the streams.")] = 2560,
    streams: Annotated[int, typer.Option(help="Chat streams decoding.")] = 3,
    joins: Annotated[int, typer.Option(help="Joins of each kind (medians).")] = 20,
    threads: ThreadsOpt = 0,
    json_path: JsonOpt = None,
) -> None:
    """The steps in which a long cached prompt's last token joins decoding streams: its layers split over two
    steps beside all of them in one (in process, the bundled model)."""
    import torch

    from kvtierd.bench.join_bench import run_join_bench

    if threads:
        torch.set_num_threads(threads)
    f = _figures(lambda: run_join_bench(context, streams, joins))
    m = machine()
    typer.echo(f"machine: {cpu_line(m)}, torch {m['torch']} ({f['threads']} threads), {m['date']}")
    print_table(
        f"a {f['context_len']:,}-token cached prompt's last token joining {f['streams']} decoding streams "
        f"(ms, medians of {f['joins']} joins; the streams' own step: {f['plain_ms']:.2f})",
        ["join", "steps", "each step", "longest", "longest p90", "steps' sum"],
        [[kind, j["steps"], " / ".join(f"{t:.2f}" for t in j["each_ms"]), j["longest_ms"], j["longest_p90_ms"],
          j["total_ms"]] for kind, j in (("split by layers", f["split"]), ("whole", f["whole"]))],
    )
    write_json(json_path, {"machine": m, **f})


@bench_app.command("cpu-matmul")
def bench_cpu_matmul(
    rows: Annotated[str, typer.Option(help="Rows (a step's tokens).")] = "1,2,3,4,5,6,8,16,32",
    threads: ThreadsOpt = 0,
    json_path: JsonOpt = None,
) -> None:
    """The bundled model's int4 matrices on the CPU by a step's rows: torch's int4 kernel beside the tile kernel
    and the bfloat16 copies (where TORCH_INT4_MAX_ROWS comes from)."""
    import torch

    from kvtierd.bench.cpu_matmul_bench import layer_matrices, run_cpu_matmul_bench
    from kvtierd.model.loader import load_model

    if threads:
        torch.set_num_threads(threads)
    f = _figures(lambda: run_cpu_matmul_bench(layer_matrices(load_model()), _ints(rows)))
    m = machine()
    typer.echo(f"machine: {cpu_line(m)}, torch {m['torch']} ({f['threads']} threads), {m['date']}")
    print_table(
        f"{f['matrices']} int4 matrices, ms a step (tile kernel: {f['tile_kernel'] or 'none here'})",
        ["rows", "torch int4", "tile kernel", "bfloat16 copies"],
        [[r["rows"], r["torch_int4_ms"], "-" if r["tile_kernel_ms"] is None else r["tile_kernel_ms"], r["dense_ms"]]
         for r in f["rows"]],
    )
    typer.echo(f"torch's int4 kernel faster up to {f['torch_faster_up_to']} rows here; "
               f"TORCH_INT4_MAX_ROWS = {f['torch_int4_max_rows']}")
    write_json(json_path, {"machine": m, **f})


@bench_app.command("fleet")
def bench_fleet(
    redis_url: Annotated[Optional[str], typer.Option(help="A Redis/Valkey to use; default: start one on loopback.")] = None,
    doc_tokens: Annotated[int, typer.Option(help="Document tokens.")] = 2000,
    repeats: Annotated[int, typer.Option(help="Shared-document rounds.")] = 3,
    turns: Annotated[int, typer.Option(help="Session turns on the first host.")] = 3,
    threads: ThreadsOpt = 0,
    model: Annotated[Optional[str], typer.Option()] = None,
    json_path: JsonOpt = None,
) -> None:
    """Two hosts sharing one Redis: cross-host reuse vs recompute, and the remote tier's load bandwidth."""
    from kvtierd.bench.fleet_bench import run_fleet_bench
    from kvtierd.model.loader import load_model

    if min(doc_tokens, repeats, turns) < 1:
        raise typer.BadParameter("--doc-tokens, --repeats and --turns must be at least 1")
    if threads > 0:
        import torch

        torch.set_num_threads(threads)
    f = _figures(lambda: run_fleet_bench(load_model(model), redis_url, doc_tokens, repeats, turns))
    m = machine()
    typer.echo(f"machine: {cpu_line(m)}, torch {m['torch']} ({m['torch_threads']} threads), "
               f"{m['date']}; redis: {f['redis']}")
    print_table(f"shared document ({f['doc_tokens']:,} tokens): host B, after host A answered another question",
                ["prompt", "cached", "from remote", "TTFT B ms", "TTFT recompute ms", "speedup"],
                [[r["prompt_tokens"], r["cached_tokens"], r["remote_tokens"], r["ttft_remote_ms"],
                  r["ttft_recompute_ms"], r["speedup"]] for r in f["shared_document"]])
    s = f["session"]
    print_table(f"a session's next turn on host B after {s['turns_on_a']} turns on host A",
                ["prompt", "cached", "from remote", "TTFT B ms", "TTFT recompute ms", "speedup"],
                [[s["prompt_tokens"], s["cached_tokens"], s["remote_tokens"], s["ttft_on_b_ms"],
                  s["ttft_recompute_ms"], s["speedup"]]])
    bw = f["bandwidth"]
    print_table(f"remote tier bandwidth: {bw['chunks']} chunks, {bw['payload_bytes'] / 1e6:.1f} MB of KV payload "
                f"({bw['stored_bytes'] / 1e6:.1f} MB stored), GB/s of payload, median of {bw['rounds']} rounds",
                [f"store loads ({bw['codec']})", "store loads (raw codec)", "store get_many", "raw pipelined GET",
                 "raw SET", "loads / raw GET"],
                [[bw["store_load_GB_s"], bw["store_load_raw_codec_GB_s"], bw["store_get_GB_s"], bw["raw_get_GB_s"],
                  bw["raw_set_GB_s"], f"{bw['store_load_share_of_raw_get']:.0%}"]])
    typer.echo(f"store loads: get, HMAC, frame checks, decode and one copy out per chunk, {bw['workers']} at a time "
               "(as the transfer workers run them); target >= 0.5 GB/s of payload")
    write_json(json_path, {"machine": m, **f})


@bench_app.command("soak")
def bench_soak(
    socket: Annotated[Optional[Path], typer.Option(help="Soak the daemon on this socket; default: start one.")] = None,
    sessions: Annotated[int, typer.Option(help="Chat sessions, one streamed turn each per round.")] = 16,
    rounds: Annotated[int, typer.Option(help="Rounds after a warm-up round.")] = 5,
    concurrency: Annotated[int, typer.Option(help="Requests in flight at once.")] = 8,
    max_tokens: Annotated[int, typer.Option()] = 16,
    disconnect_p: Annotated[float, typer.Option(help="Chance a client hangs up after the first chunk.")] = 0.3,
    seed: Annotated[int, typer.Option()] = 0,
    json_path: JsonOpt = None,
) -> None:
    """Sessions, stateless chats and bad requests with random hang-ups; RSS and pages back to baseline?"""
    from kvtierd.bench.serve_bench import ServeBenchError
    from kvtierd.bench.soak_bench import run_soak_bench

    if min(sessions, rounds, concurrency, max_tokens) < 1 or not 0 <= disconnect_p <= 1:
        raise typer.BadParameter("counts must be at least 1 and --disconnect-p in [0, 1]")
    try:
        f = run_soak_bench(socket, sessions, rounds, concurrency, max_tokens, disconnect_p, seed)
    except ServeBenchError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    m = machine()
    typer.echo(f"machine: {cpu_line(m)}, torch {m['torch']}, {m['date']}; daemon: {f['daemon']}")
    typer.echo(f"{f['sessions']} sessions x {f['rounds']} rounds, {f['concurrency']} at once, max_tokens "
               f"{f['max_tokens']}, hang-up chance {f['disconnect_p']:.0%}: {f['requests']} requests in "
               f"{f['wall_s']:.1f} s; 5xx seen: {f['errors_5xx']}")
    print_table("outcomes", ["outcome", "requests"], sorted(f["outcomes"].items(), key=lambda kv: -kv[1]))
    b, a = f["before"], f["after"]
    print_table("daemon before and after (idle)", ["", "RSS MB", "pages used", "pages cached", "pages free"],
                [["before", b["rss_bytes"] / 1e6, b["used_blocks"], b["cached_blocks"], b["free_blocks"]],
                 ["after", a["rss_bytes"] / 1e6, a["used_blocks"], a["cached_blocks"], a["free_blocks"]]])
    typer.echo(f"pages in use back to 0: {'yes' if f['pages_back_to_baseline'] else 'NO'}; RSS growth "
               f"{f['rss_growth']:+.1%} (tolerance {f['rss_tolerance']:.0%}): "
               f"{'within' if f['rss_within_tolerance'] else 'OVER'}")
    write_json(json_path, f)
    if not (f["pages_back_to_baseline"] and f["rss_within_tolerance"]) or f["errors_5xx"]:
        raise typer.Exit(1)


@bench_app.command("qos")
def bench_qos(
    high_requests: Annotated[int, typer.Option(help="High-priority requests in each run (the samples).")] = 100,
    high_every: Annotated[float, typer.Option(help="Seconds between two scheduled high-priority arrivals.")] = 1.0,
    high_reply: Annotated[int, typer.Option(help="Tokens of each high-priority reply.")] = 16,
    low_clients: Annotated[int, typer.Option(help="Low-priority clients flooding, back to back.")] = 16,
    low_prompt: Annotated[int, typer.Option(help="Tokens of each low-priority prompt.")] = 1000,
    low_reply: Annotated[int, typer.Option(help="Tokens of each low-priority reply.")] = 64,
    kv_cache: Annotated[str, typer.Option(help="The daemons' device KV pool.")] = "128MiB",
    step_budget: Annotated[str, typer.Option(help="The qos run's [qos] step_budget_ms.")] = "high=auto,normal=auto",
    runs: Annotated[str, typer.Option(help="Runs, comma-separated, of: unloaded, qos, no budget, no qos "
                                      "(high queued behind the flood: minutes).")] = "unloaded,qos,no budget",
    json_path: JsonOpt = None,
) -> None:
    """High-priority TTFT and ITL under a low-priority flood, through real daemons and clients on the socket:
    time-bounded steps (qos) beside no step budget, no QoS and unloaded."""
    from kvtierd.bench.qos_bench import QosWorkload, run_qos_bench
    from kvtierd.bench.serve_bench import ServeBenchError

    w = QosWorkload(high_requests=high_requests, high_every_s=high_every, high_reply_tokens=high_reply,
                    low_clients=low_clients, low_prompt_tokens=low_prompt, low_reply_tokens=low_reply,
                    kv_cache=kv_cache, step_budget=step_budget)
    try:
        f = run_qos_bench(w, tuple(r.strip() for r in runs.split(",") if r.strip()))
    except ServeBenchError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    m = f["machine"]
    typer.echo(f"machine: {cpu_line(m)}, torch {m['torch']} "
               f"({m['torch_threads']} threads), {m['date']}")

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:,.0f}"

    rows = []
    for r in f["runs"]:
        for cls in ("high", "low"):
            if cls == "low" and r["low_tokens_per_s"] is None:
                continue  # no flood
            lat = r[cls] or {"requests": 0}  # no low request ended in the window: its throughput still shows
            rows.append([r["run"], cls, lat["requests"], *(ms(lat.get(k)) for k in (
                "ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p95_ms", "itl_p99_ms")),
                "-" if cls == "high" or r["low_tokens_per_s"] is None else f"{r['low_tokens_per_s']:.1f}"])
    # Short headers keep the table inside an 80-column terminal.
    print_table("QoS through the daemon (ms; TTFT from the scheduled arrival)",
                ["run", "class", "n", "TTFT p50", "p95", "p99", "ITL p50", "p95", "p99", "low tok/s"], rows)
    print_table("high-priority p95 over the unloaded p95",
                ["run", "TTFT p95 x", "ITL p95 x"],
                [[r["run"], f"{r['ttft_p95_x']:.2f}" if "ttft_p95_x" in r else "-",
                  f"{r['itl_p95_x']:.2f}" if "itl_p95_x" in r else "-"] for r in f["runs"]])
    errors = sum(r["high_errors"] + r["low_errors"] for r in f["runs"])
    t = f["targets"]

    def met(key: str) -> str:
        return "-" if key not in f else "met" if f[key] else "NOT met"

    share = f.get("low_throughput_share")
    typer.echo(f"targets (qos run): TTFT p95 <= {t['ttft_p95_x']:g}x unloaded: {met('ttft_target_met')}; ITL p95 <= "
               f"{t['itl_p95_x']:g}x unloaded: {met('itl_target_met')}; low throughput "
               f"{'-' if share is None else f'{share:.0%}'} of no budget's (>= {t['low_throughput_share']:.0%}): "
               f"{met('throughput_target_met')}; request errors: {errors}")
    write_json(json_path, f)


@bench_app.command("stall")
def bench_stall(
    prompt_tokens: Annotated[int, typer.Option(help="Tokens of the long prompt loaded from below.")] = 2560,
    streams: Annotated[int, typer.Option(help="Chat streams decoding while it loads.")] = 3,
    stream_reply: Annotated[int, typer.Option(help="Tokens of each stream request.")] = 256,
    head_start: Annotated[float, typer.Option(help="Seconds the streams run before the load.")] = 6.0,
    redis_delay_ms: Annotated[float, typer.Option(help="What the slow proxy adds to each Redis call.")] = 300.0,
    kv_cache: Annotated[str, typer.Option(help="The daemons' device KV pool.")] = "512MiB",
    scenarios: Annotated[str, typer.Option(help="Comma-separated, of: disk, remote, remote slow, "
                                           "remote stopped.")] = "disk,remote,remote slow,remote stopped",
    turn_tokens: Annotated[int, typer.Option(help="Stores: the long first turn's document tokens.")] = 1450,
    turn_repeats: Annotated[int, typer.Option(help="Stores: next turns of each kind (median; 0: skip).")] = 2,
    load_repeats: Annotated[int, typer.Option(help="Long prompts loaded per scenario (TTFT: median; ITL gaps: "
                                              "pooled).")] = 8,
    stream_priority: Annotated[Optional[str], typer.Option(
        help="The streams' QoS class (high: the step budget guards them from the long prompts, which stay "
             "normal); default: the long prompts' own.")] = None,
    prefill_share: Annotated[float, typer.Option(
        help="The daemons' [engine] prefill_share: a prompt beside the streams adds at most this share to their "
             "step; 0: off (the default).")] = 0.0,
    json_path: JsonOpt = None,
) -> None:
    """Running streams' ITL while another request's long prompt loads from disk or Redis (normal, slow, stopped),
    and a next turn sent while the turn before it is stored, through real daemons on the socket."""
    from kvtierd.bench.serve_bench import ServeBenchError
    from kvtierd.bench.stall_bench import StallWorkload, run_stall_bench

    w = StallWorkload(prompt_tokens=prompt_tokens, streams=streams, stream_reply_tokens=stream_reply,
                      head_start_s=head_start, redis_delay_ms=redis_delay_ms, kv_cache=kv_cache,
                      scenarios=tuple(x.strip() for x in scenarios.split(",") if x.strip()),
                      turn_tokens=turn_tokens, turn_repeats=turn_repeats, load_repeats=load_repeats,
                      stream_priority=stream_priority, prefill_share=prefill_share)
    try:
        f = run_stall_bench(w)
    except ServeBenchError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    m = f["machine"]
    typer.echo(f"machine: {cpu_line(m)}, torch {m['torch']} "
               f"({m['torch_threads']} threads), {m['date']}; load average "
               + " ".join(f"{x:.2f}" for x in f["load_average"]))

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:,.0f}"

    def times(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    rows = []
    for r in f["scenarios"]:
        a, b = r["without_load"], r["with_load"]
        rows.append([r["scenario"], ", ".join(f"{t} {n}" for t, n in r["loaded_by_tier"].items()) or "none",
                     f"{a['gaps']}/{b['gaps']}", *(ms(a[k]) + " / " + ms(b[k]) for k in ("p50_ms", "p99_ms", "max_ms")),
                     *(times(r[k]) for k in ("itl_p99_x", "device_hit_itl_p99_x", "recompute_itl_p99_x")),
                     ms(r["ttft_load_ms"]), ms(r["ttft_device_hit_ms"]), ms(r["ttft_recompute_ms"])])
    print_table(f"running streams' ITL without / with a {w.prompt_tokens:,}-token prompt loading (ms; "
                f"{w.streams} streams{f' of priority {w.stream_priority}' if w.stream_priority else ''}; "
                f"{f'prefill share {w.prefill_share:g}; ' if w.prefill_share else ''}"
                f"{w.load_repeats} loads, TTFT median)",
                ["scenario", "cached by tier", "gaps", "ITL p50", "p99", "max", "p99 x", "x hit", "x recompute",
                 "TTFT load", "TTFT hit", "TTFT recompute"], rows)
    t = f["targets"]
    typer.echo("TTFT each (load / recompute): " + "; ".join(
        f"{r['scenario']} (warm-up load {r['ttft_warm_load_ms']:,.0f}) "
        + ", ".join(f"{a:,.0f}/{b:,.0f}" for a, b in zip(r["ttft_load_all_ms"], r["ttft_recompute_all_ms"]))
        for r in f["scenarios"]))
    typer.echo(f"window: the load request's TTFT; without: the same length right before it; x: the streams' ITL p99 "
               f"in the window over without; hit: the same prompt sent again, its pages on the device (the long "
               f"context with nothing to transfer); recompute: a fresh prompt of its length. Targets: ITL p99 <= "
               f"{t['itl_p99_x']:g}x without; slow / stopped Redis: TTFT load <= recompute")
    for r in f["scenarios"]:
        cut = sum(q < w for q, w in zip(r["quiet_spell_all_ms"], r["window_all_ms"], strict=True))
        if cut:
            typer.echo(f"{r['scenario']}: {cut} load(s) ran past the quiet spell before them: their window without "
                       f"is that spell, shorter than their own")
    by_name = {r["scenario"]: r for r in f["scenarios"]}
    if "disk" in by_name:  # its fresh prompts pay no remote tier: recomputing as a daemon without the fleet does
        ref = by_name["disk"]["ttft_recompute_ms"]
        for name in ("remote slow", "remote stopped"):
            if name in by_name:
                r = by_name[name]
                typer.echo(f"{name}: TTFT load {r['ttft_load_ms'] / ref:.2f}x and a fresh prompt's "
                           f"{r['ttft_recompute_ms'] / ref:.2f}x recomputing without the remote tier (the disk "
                           f"daemon's fresh prompts, {ref:,.0f} ms)")
    nt = f["next_turn"]
    if nt is not None:
        print_table(f"stores: a session's next turn after a {w.turn_tokens:,}-token first turn (TTFT ms, median of "
                    f"{w.turn_repeats})",
                    ["sent", "TTFT", "x later"],
                    [["right after (its KV being stored)", ms(nt["right_after_ms"]), f"{nt['x']:.2f}"],
                     [f"{f['workload']['turn_later_s']:g} s later", ms(nt["later_ms"]), "1.00"]])
        typer.echo(f"target: right after <= {t['next_turn_x']:g}x later")
    write_json(json_path, f)


@bench_app.command("tenants")
def bench_tenants(
    kv_pages: Annotated[int, typer.Option(help="Device KV pool in pages of 16 tokens.")] = 128,
    host_pages: Annotated[int, typer.Option(help="The host tier's slab in pages (the host-tier runs).")] = 128,
    rounds: Annotated[int, typer.Option(help="Rounds: one quiet request and the flood's prompts each.")] = 12,
    noisy_per_round: Annotated[int, typer.Option(help="Flood prompts (unique, long) per round.")] = 3,
    noisy_tokens: Annotated[int, typer.Option(help="Tokens per flood prompt.")] = 256,
    doc_tokens: Annotated[int, typer.Option(help="Tokens per hot document of the quiet tenant.")] = 256,
    threads: Annotated[int, typer.Option(help="torch threads (1: steady timings on a shared machine).")] = 1,
    model: Annotated[Optional[str], typer.Option()] = None,
    json_path: JsonOpt = None,
) -> None:
    """A quiet tenant's hits and TTFT under a noisy tenant's flood: cache shares on and off, host tier off and on."""
    import os

    import torch

    from kvtierd.bench.tenants_bench import TenantsWorkload, run_tenants_bench
    from kvtierd.model.loader import load_model

    torch.set_num_threads(threads)
    w = TenantsWorkload(kv_pages=kv_pages, host_pages=host_pages, rounds=rounds, noisy_per_round=noisy_per_round,
                        noisy_tokens=noisy_tokens, doc_tokens=doc_tokens)
    f = run_tenants_bench(load_model(model), w)
    m = f["machine"] = machine()
    f["load_average"] = os.getloadavg()
    typer.echo(f"machine: {cpu_line(m)}, torch {m['torch']} "
               f"({m['torch_threads']} threads), {m['date']}, load average {f['load_average'][0]:.2f}")
    print_table(f"The quiet tenant under a flood of {f['workload']['flood_x_pool']:.1f}x the device pool "
                "(engine time)",
                ["host tier", "run", "device hit", "host hit", "vs alone", "p50 ms", "p95 ms"],
                [["on" if r["host_tier"] else "off", r["run"], f"{r['device_hit_rate']:.1%}",
                  f"{r['host_hit_rate']:.1%}" if r["host_tier"] else "-",
                  f"{(r['memory_vs_alone'] if r['host_tier'] else r['device_vs_alone']):.1%}",
                  f"{r['ttft_p50_ms']:,.0f}", f"{r['ttft_p95_ms']:,.0f}"] for r in f["runs"]])
    def verdict(met: bool | None) -> str:
        return "n/a (no hits alone: raise --rounds)" if met is None else "met" if met else "NOT met"

    t = f["targets"]
    typer.echo(f"targets with shares: host off, device hits >= {f['device_target']:.0%} of alone: "
               f"{verdict(t['device_hits_host_off'])}; host on, device + host >= {f['memory_target']:.0%} of alone: "
               f"{verdict(t['memory_hits_host_on'])}")
    under = ", ".join(f"{r['run']} {r['evictions_under_share']}" for r in f["runs"] if r["run"] != "alone")
    typer.echo(f"device pages evicted from a tenant under its share (host off, then on): {under}")
    for tier, split in f["ttft_split_p50"].items():
        typer.echo(f"TTFT p50 over alone ({tier}): {split['flood_compute_ms']:,.0f} ms the flood's compute (shares on), "
                   f"{split['lost_cache_ms']:,.0f} ms more from the lost cache (shares off)")
    write_json(json_path, f)


@bench_app.command("qos-engine")
def bench_qos_engine(
    kv_pages: Annotated[int, typer.Option(help="Device KV budget in pages of 16 tokens.")] = 64,
    low_sessions: Annotated[int, typer.Option(help="Low-priority sessions flooding the cache.")] = 12,
    high_requests: Annotated[int, typer.Option(help="High-priority requests in the stream.")] = 12,
    high_every: Annotated[float, typer.Option(help="Seconds between two high-priority requests.")] = 0.25,
    reserved_share: Annotated[float, typer.Option(help="Share of the pages reserved for high.")] = 0.25,
    reserve_window: Annotated[float, typer.Option(help="The resizing run's window in seconds.")] = 1.0,
    threads: Annotated[int, typer.Option(help="torch threads (1: steady timings on a shared machine).")] = 1,
    model: Annotated[Optional[str], typer.Option()] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write the resizing reserve's size over time "
                                                 "to this PNG (needs matplotlib: the bench extra).")] = None,
    json_path: JsonOpt = None,
) -> None:
    """High-priority TTFT under a flood of low-priority sessions: reserved region (fixed and resizing), no reserve,
    no QoS, unloaded."""
    import torch

    from kvtierd.bench.plot import PlotError, plot_reserve, pyplot
    from kvtierd.bench.qos_engine_bench import QosWorkload, run_qos_bench
    from kvtierd.engine.errors import RequestError
    from kvtierd.model.loader import load_model

    if reserve_window <= 0:
        raise typer.BadParameter("--reserve-window must be positive")
    if plot is not None:
        try:
            pyplot()  # before the runs: a missing matplotlib should not cost a whole benchmark
        except PlotError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from e
    torch.set_num_threads(threads)
    w = QosWorkload(kv_pages=kv_pages, low_sessions=low_sessions, high_requests=high_requests,
                    high_every_s=high_every, reserved_share=reserved_share, reserved_window_s=reserve_window)
    try:
        figures = run_qos_bench(load_model(model), w)
    except RequestError as e:  # e.g. a low request too big for the pages a reserve leaves it
        typer.echo(f"error: {e} (here: --kv-pages)", err=True)
        raise typer.Exit(2) from e

    def reserved(r: dict) -> str:  # a resizing reserve: the smallest and largest sizes it took
        sizes = [p[1] for p in r.get("reserve_series", [])] or [r["reserved_pages"]]
        span = f"{min(sizes)}" if min(sizes) == max(sizes) else f"{min(sizes)}-{max(sizes)}"
        return f"{span}/{r['kv_pages']}"

    # Whole ms and short headers keep the table inside an 80-column terminal.
    print_table("High-priority TTFT under a low-priority flood (engine time)",
                ["run", "p50 ms", "p95 ms", "p95 x", "low tok/s", "preempt", "reserved"],
                [[r["run"], f"{r['ttft_p50_ms']:,.0f}", f"{r['ttft_p95_ms']:,.0f}", r["p95_vs_unloaded_x"],
                  "-" if r["low_tokens_per_s"] is None else r["low_tokens_per_s"], r["preemptions"], reserved(r)]
                 for r in figures["runs"]])
    resizing = next(r for r in figures["runs"] if "reserve_series" in r)
    typer.echo(f"p95 x: over the unloaded p95. reserved: pages only high may take; the resizing run resized "
               f"{resizing['resizes']} times (floor {resizing['reserved_floor']}, ceiling "
               f"{resizing['reserved_ceiling']} pages, {w.reserved_window_s:g} s window)")
    lost = figures["low_throughput_lost_to_reserve"]
    met = "met" if figures["target_met"] else "NOT met"
    print(f"target: reserved p95 <= {figures['target_p95_x']}x unloaded: {met}; low throughput lost to the "
          f"reserve: {'-' if lost is None else f'{lost:.1%}'}; {machine()['cpu']}, {machine()['torch_threads']} thread(s)")
    write_json(json_path, figures)
    if plot is not None:
        plot_reserve(resizing["reserve_series"], resizing["reserve_resizes"], resizing["kv_pages"],
                     f"The reserved region following high's page use ({w.reserved_window_s:g} s window)", plot)
        typer.echo(f"plot: {plot}")


@bench_app.command("reuse")
def bench_reuse(
    turns: Annotated[int, typer.Option(help="Multi-turn: chat turns over one document.")] = 8,
    doc_tokens: Annotated[str, typer.Option(help="Document tokens: multi-turn,shared (one value: both).")] = (
        "1500,2000"
    ),
    requests: Annotated[int, typer.Option(help="Shared document: questions over one document.")] = 16,
    lookup_tokens: Annotated[int, typer.Option(help="Lookup cost: prompt length.")] = 1000,
    threads: ThreadsOpt = 0,
    model: Annotated[Optional[str], typer.Option()] = None,
    json_path: JsonOpt = None,
) -> None:
    """Prefix index on vs off: multi-turn TTFT, prefill tokens over a shared document, lookup cost."""
    from kvtierd.bench.reuse_bench import run_reuse_bench
    from kvtierd.model.loader import load_model

    docs = _ints(doc_tokens)
    if len(docs) not in (1, 2) or min(docs) < 1 or turns < 1 or requests < 1 or lookup_tokens < 2:
        raise typer.BadParameter("--doc-tokens takes one or two positive counts; --turns and --requests >= 1, "
                                 "--lookup-tokens >= 2")
    if threads > 0:
        import torch

        torch.set_num_threads(threads)
    figures = run_reuse_bench(load_model(model), turns, docs[0], docs[-1], requests, lookup_tokens)
    m = machine()
    typer.echo(f"machine: {cpu_line(m)}, torch {m['torch']} ({m['torch_threads']} threads), {m['date']}")
    mt = figures["multi_turn"]
    typer.echo(
        f"multi-turn: {mt['turns']} turns over a {mt['doc_tokens']:,}-token document, one session; each prompt is "
        f"the whole rendered history; greedy replies of up to {mt['reply_tokens']} tokens from the cached run, so both "
        "sides see the same prompts; TTFT is engine time, the two sides interleaved turn by turn"
    )
    print_table(
        "multi-turn TTFT: session pool vs full recompute",
        ["turn", "prompt tokens", "cached", "from", "TTFT hit ms", "TTFT recompute ms", "speedup"],
        [[r["turn"], r["prompt_tokens"], r["cached_tokens"], r["source"], r["ttft_cached_ms"], r["ttft_recompute_ms"],
          r["speedup"]] for r in mt["rows"]],
    )
    if mt["speedup_later_turns_median"] is not None:
        typer.echo(
            f"turns 2-{mt['turns']}: speedup median {mt['speedup_later_turns_median']:.1f}x, "
            f"min {mt['speedup_later_turns_min']:.1f}x (target >= {mt['target']:.0f}x)"
        )
    sd = figures["shared_document"]
    typer.echo(
        f"shared document: {sd['requests']} questions over one {sd['doc_tokens']:,}-token document, max_tokens 1 "
        "(wall time is prefill); a fresh engine per row"
    )
    print_table(
        f"shared document: prefill tokens computed of {sd['runs'][0]['prompt_tokens']:,} prompt tokens",
        ["index", "sent", "computed", "cached", "fewer x", "no hit", "wall s", "wall x"],
        [["on" if r["prefix_index"] else "off", r["submission"], r["prefill_tokens_computed"], r["cached_tokens"],
          r["fewer_prefill_x"], r["requests_without_hit"], r["wall_s"], r["wall_speedup"]] for r in sd["runs"]],
    )
    typer.echo(f"target: >= {sd['target']:.0f}x fewer prefill tokens with the index. no hit: requests that found "
               "no cached page. Without the index every prompt token is computed in any order, so it runs once.")
    lk = figures["lookup"]
    print_table(
        f"hashing and lookup, block size {lk['block_size']} (medians)",
        ["tokens", "hash us", "find_prefix us", "hit TTFT ms", "cold TTFT ms", "lookup / hit TTFT"],
        [[lk["tokens"], lk["hash_us"], lk["lookup_us"], lk["hit_ttft_ms"], lk["cold_ttft_ms"],
          f"{lk['lookup_share_of_hit_ttft']:.3%}"]],
    )
    typer.echo(f"find_prefix hashes the prompt, then confirms each page's tokens; target: < "
               f"{lk['target_share']:.0%} of a hit's TTFT")
    write_json(json_path, figures)


@bench_app.command("startup")
def bench_startup(
    repeats: Annotated[int, typer.Option(help="Loads of each kind, alternated (median).")] = 5,
    processes: Annotated[int, typer.Option(help="Fresh daemons started to their first token (median).")] = 3,
    model: Annotated[Optional[str], typer.Option()] = None,
    json_path: JsonOpt = None,
) -> None:
    """Model load from the GGUF file vs from the converted-model cache ([model] cache_dir); a fresh daemon's
    process start to its first token."""
    from dataclasses import asdict

    from kvtierd.bench.startup_bench import run_startup_bench

    if repeats < 1 or processes < 1:
        raise typer.BadParameter("--repeats and --processes must be at least 1")
    f = run_startup_bench(model, repeats, processes)
    m = machine()
    typer.echo(f"machine: {cpu_line(m)}, torch {m['torch']} ({m['torch_threads']} threads), "
               f"{m['date']}; model {f.model}, loads alternated, median of {f.repeats}")
    print_table(
        "model load (to a ready LlamaModel and tokenizer, float32 on the CPU)",
        ["from", "s", "x faster"],
        [["GGUF (read, dequantize, fuse)", f.gguf_s, 1.0], ["converted-model cache", f.cached_s, f.speedup],
         ["first load: convert and store", f.convert_and_store_s, "-"]],
    )
    typer.echo(f"cache entry: {f.entry_bytes / 1e6:,.0f} MB; cached model equal to the GGUF's: "
               f"{'yes' if f.equal else 'NO'}")
    print_table(
        f"a fresh `kvtierd serve` (converted-model cache warm), median of {f.processes}",
        ["from process start to", "s"],
        [["/healthz answers", f.process_ready_s], ["first token of a first request", f.process_first_token_s],
         ["(that request's own TTFT)", f.first_request_ttft_s]],
    )
    write_json(json_path, asdict(f))


@bench_app.command("tiers")
def bench_tiers(
    restore_tokens: Annotated[int, typer.Option(help="Restore: the session's prompt tokens.")] = 2000,
    repeats: Annotated[int, typer.Option(help="Restore: repetitions per tier (median).")] = 5,
    recompute_repeats: Annotated[int, typer.Option(help="Restore: prefills of the same prompt (median).")] = 3,
    chunks: Annotated[int, typer.Option(help="Disk bandwidth: chunks written and read back, per codec.")] = 32,
    sessions: Annotated[int, typer.Option(help="Working set: chat sessions, one turn each in round robin.")] = 16,
    history_tokens: Annotated[int, typer.Option(help="Working set: each session's first prompt.")] = 384,
    rounds: Annotated[int, typer.Option(help="Working set: turns per session (the first is not measured).")] = 3,
    device_share: Annotated[float, typer.Option(help="Working set: the device pool, as a share of the "
                                                     "sessions' KV.")] = 0.25,
    host_share: Annotated[float, typer.Option(help="Working set: the host tier, as a share of the sessions' KV "
                                                   "(the disk tier holds all).")] = 0.5,
    directory: Annotated[Optional[Path], typer.Option("--dir", help="Where the LMDB stores and the raw file go "
                                                      "(on the disk to measure); default: the temp dir.")] = None,
    daemon: Annotated[bool, typer.Option(help="Next turn: also a stored session's, through a daemon restarted "
                                               "by the bench.")] = True,
    threads: ThreadsOpt = 0,
    model: Annotated[Optional[str], typer.Option()] = None,
    json_path: JsonOpt = None,
) -> None:
    """Host, disk and remote tiers: a next turn's TTFT vs recompute, disk vs raw bandwidth, codecs, a working set
    4x the device."""
    from dataclasses import asdict

    from kvtierd.bench.tiers_bench import TiersWorkload, run_tiers_bench
    from kvtierd.model.loader import load_model

    try:
        w = TiersWorkload(restore_tokens=restore_tokens, restore_repeats=repeats, recompute_repeats=recompute_repeats,
                          bandwidth_chunks=chunks, sessions=sessions, history_tokens=history_tokens, rounds=rounds,
                          device_share=device_share, host_share=host_share, daemon=daemon)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    if threads > 0:
        import torch

        torch.set_num_threads(threads)
    f = run_tiers_bench(load_model(model), w, directory)
    m = machine()
    typer.echo(f"machine: {cpu_line(m)}, torch {m['torch']} ({m['torch_threads']} threads), {m['date']}")

    def yes(ok: bool) -> str:
        return "yes" if ok else "NO"

    r = f.restore
    typer.echo(
        f"next turn: a {r.prompt_tokens:,}-token turn was computed; its next turn ({r.next_turn_tokens:,} tokens) "
        f"finds its {r.stored_tokens:,} tokens of KV ({r.chunks} chunks, {r.kv_bytes / 1e6:.1f} MB) in one tier "
        f"only; TTFT through the engine (lookup, load, the rest of the prefill, the first token), each on a fresh "
        f"engine, median of {r.repeats}; recompute: the same turn from scratch, median of {w.recompute_repeats}"
    )

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:,.1f}"

    print_table(
        "next turn: TTFT with the KV in a tier vs recomputed",
        ["KV from", "TTFT ms", "x faster", "loaded", "computed", "same token"],
        [["recompute", ms(r.recompute_ms), "1.00", 0, r.next_turn_tokens, "-"]]
        + [[row.source, ms(row.ttft_ms), "-" if row.speedup is None else f"{row.speedup:.2f}", row.loaded_tokens,
            row.computed_tokens, "-" if row.skipped else yes(row.same_first_token)] for row in r.rows],
    )
    ttft = {row.source: row.ttft_ms for row in r.rows}
    if ttft.get("device") is not None:
        from kvtierd.bench.tiers_bench import DISK_TARGET_READS, HOST_TARGET_X

        host_max, disk_max = HOST_TARGET_X * ttft["device"], ttft["device"] + DISK_TARGET_READS * r.raw_read_ms
        typer.echo(f"targets: host <= {HOST_TARGET_X}x the device hit = {host_max:,.1f} ms "
                   f"({'met' if ttft['host'] <= host_max else 'NOT met'}); disk cold <= the device hit + "
                   f"{DISK_TARGET_READS}x a plain file's cold read of the {r.kv_bytes / 1e6:.1f} MB "
                   f"({r.raw_read_ms:,.1f} ms) = {disk_max:,.1f} ms ({'met' if ttft['disk cold'] <= disk_max else 'NOT met'})")
    skipped = "; ".join(f"{row.source}: skipped ({row.skipped})" for row in r.rows if row.skipped)
    typer.echo("disk warm: data.mdb in the OS page cache, as written; disk cold: its pages dropped "
               "(POSIX_FADV_DONTNEED) before each turn's engine opens it; remote: a redis-server on loopback "
               f"started by the bench{'; ' + skipped if skipped else ''}")
    d = r.daemon
    if d is None:
        typer.echo(f"through the daemon: skipped ({r.daemon_skipped})")
    else:
        print_table(
            f"through the daemon's socket: a stored session's next turn after a restart ({d.prompt_tokens:,} "
            "prompt tokens, streamed)",
            ["", "TTFT ms", "x faster", "cached by tier", "same reply"],
            [["fresh tenant (recompute)", d.ttft_recompute_ms, 1.0, "-", "-"],
             ["session after restart", d.ttft_restored_ms, d.speedup,
              ", ".join(f"{t} {n}" for t, n in d.cached_by_tier.items()) or "none", yes(d.same_reply)]],
        )
    b = f.disk_bandwidth
    typer.echo(f"disk bandwidth: {b.chunks} chunks of real KV, {b.payload_bytes / 1e6:,.0f} MB of payload, "
               f"in {b.directory}")
    print_table(
        "disk tier (LMDB, per codec) vs a plain file: GB/s of KV payload",
        ["", "write", "read cold", "read warm", "write / raw", "read / raw"],
        [[row.codec + (" (auto)" if row.codec == b.auto_codec else ""), row.write_GB_s, row.read_cold_GB_s,
          row.read_warm_GB_s, f"{row.write_share_of_raw:.0%}", f"{row.read_share_of_raw:.0%}"] for row in b.rows]
        + [["plain file", b.raw_write_GB_s, b.raw_read_cold_GB_s, "-", "-", "-"]],
    )
    stored = ", ".join(f"{row.codec} {row.stored_bytes / 1e6:,.0f} MB" for row in b.rows)
    typer.echo(f"LMDB: the disk writer thread encodes each chunk and commits it in its own fsynced transaction; a "
               f"read gets one chunk, checks and decodes its frame; stored: {stored}; read back as written: "
               f"{yes(all(row.payload_equal for row in b.rows))}. Plain file: sequential, one fsync, read cold. "
               f"Target: >= {b.target_share:.0%} of raw, cold against cold")
    c = f.codecs
    print_table(
        f"codecs on {c.chunks} chunks of real KV ({c.dtype}, {c.payload_bytes / 1e6:,.0f} MB, and cast to "
        "bfloat16; medians)",
        ["codec", "KV dtype", "ratio", "compress GB/s", "decode into place GB/s", "exact"],
        [[row.codec, row.dtype, row.ratio, row.compress_GB_s, row.decompress_GB_s, yes(row.exact)]
         for row in c.rows],
    )
    ws = f.working_set
    typer.echo(
        f"working set: {ws.sessions} sessions, {ws.working_set_tokens:,} tokens in their first prompts; device pool "
        f"{ws.device_pages} pages of {ws.block_size} tokens, host tier {ws.host_slots} chunks of {ws.chunk_pages} "
        f"pages, disk holds all; {ws.rounds} turns each, round robin, the first not measured: "
        f"{ws.runs[0].requests} requests per run, the same prompts"
    )
    print_table(
        "working set: TTFT and where the prompt tokens came from",
        ["run", "TTFT p50 ms", "TTFT p95 ms", "device", "host", "disk", "computed"],
        [[run.run, run.ttft_p50_ms, run.ttft_p95_ms]
         + [f"{run.share_by_tier[t]:.1%}" for t in ("device", "host", "disk", "computed")] for run in ws.runs],
    )
    tiered = ws.runs[0]
    typer.echo(f"TTFT p50 with tiers: {ws.ttft_p50_speedup:.1f}x faster than device only. Wall time of the "
               f"measured turns with their background disk writes: "
               + ", ".join(f"{run.run} {run.wall_s:.1f} s" for run in ws.runs)
               + f" (of which waiting for the writes: {tiered.write_wait_s:.2f} s)")
    write_json(json_path, asdict(f))
