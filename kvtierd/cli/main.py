"""`kvtierd`: try the engine (`generate`, `chat`) and run the benchmarks (`bench ...`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvtierd.cli.bench import bench_app

app = typer.Typer(no_args_is_help=True, add_completion=False, help="kvtierd: a tiered KV-cache LLM daemon.")
app.add_typer(bench_app, name="bench")
config_app = typer.Typer(no_args_is_help=True, help="The daemon's settings file.")
app.add_typer(config_app, name="config")

ModelOpt = Annotated[Optional[str], typer.Option("--model", help="A .gguf file or a Hugging Face directory; default: bundled SmolLM2-135M-Instruct.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu, cuda or cuda:N.")]
DtypeOpt = Annotated[Optional[str], typer.Option(
    "--dtype", help="Weights: auto, float32 (exact), bfloat16, float16, int8 or int4 (CPU).")]


def _engine(model: str | None, device: str, dtype: str | None):
    from kvtierd.engine.llm_engine import LLMEngine
    from kvtierd.model.errors import ModelLoadError
    from kvtierd.model.loader import load_model

    try:
        return LLMEngine(load_model(model, device, dtype=dtype))
    except ModelLoadError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e


def _stream(engine, prompt_ids: list[int], params) -> str:
    from kvtierd.engine.errors import RequestError

    try:
        rid = engine.add_request(prompt_ids, params)
    except RequestError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    reply = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                reply.append(out.text)
                sys.stdout.write(out.text)
                sys.stdout.flush()
    sys.stdout.write("\n")
    return "".join(reply)


def _params(max_tokens: int, temperature: float, top_p: float, seed: int | None):
    from kvtierd.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)


@app.command()
def serve(
    # readable=False: load_settings says in one line why a file cannot be read (click would print a usage box).
    config: Annotated[Optional[Path], typer.Option("--config", readable=False, help="A TOML settings file.")] = None,
    socket: Annotated[Optional[str], typer.Option("--socket", help="Unix socket path.")] = None,
    state_dir: Annotated[Optional[str], typer.Option("--state-dir", help="State directory (SQLite, LMDB).")] = None,
    model: ModelOpt = None,
    device: Annotated[Optional[str], typer.Option("--device", help="auto, cpu, cuda or cuda:N.")] = None,
    dtype: DtypeOpt = None,
) -> None:
    """Run the daemon in the foreground (settings: TOML file < KVTIERD_* env < flags)."""
    import asyncio
    import logging

    from kvtierd.model.errors import ModelLoadError
    from kvtierd.server.daemon import serve as run_daemon
    from kvtierd.server.log_filters import quiet_client_errors
    from kvtierd.server.settings import SettingsError, load_settings
    from kvtierd.server.unix_socket import SocketBindError
    from kvtierd.storage.store_errors import SessionStoreError

    try:
        settings = load_settings(config, overrides={"socket": socket, "state_dir": state_dir, "model": model, "device": device,
                                                         "dtype": dtype})
    except SettingsError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_client_errors()
    try:
        asyncio.run(run_daemon(settings))
    except SettingsError as e:  # one found while starting (e.g. an unreadable secret file)
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    except (ModelLoadError, SocketBindError, SessionStoreError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from e


@config_app.command("example")
def config_example() -> None:
    """Print a settings file listing every setting with its help and default (systemd/kvtierd.toml.example)."""
    from kvtierd.server.settings_example import render_example

    typer.echo(render_example(), nl=False)


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="The user message (or raw text with --raw).")],
    model: ModelOpt = None,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = None,
    max_tokens: Annotated[int, typer.Option(help="Tokens to generate at most.")] = 128,
    temperature: Annotated[float, typer.Option(help="0 for greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    seed: Annotated[Optional[int], typer.Option()] = None,
    raw: Annotated[bool, typer.Option("--raw", help="Continue the text as is, without the chat template.")] = False,
) -> None:
    """Generate one reply on the local engine and stream it to stdout."""
    engine = _engine(model, device, dtype)
    tok = engine.loaded.tokenizer
    ids = tok.encode(prompt) if raw else tok.encode_chat([{"role": "user", "content": prompt}])
    _stream(engine, ids, _params(max_tokens, temperature, top_p, seed))


@app.command()
def chat(
    model: ModelOpt = None,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = None,
    max_tokens: Annotated[int, typer.Option(help="Tokens per reply at most.")] = 256,
    temperature: Annotated[float, typer.Option(help="0 for greedy.")] = 0.0,
    system: Annotated[Optional[str], typer.Option(help="A system prompt.")] = None,
) -> None:
    """Chat with the local model in the terminal (an empty line or EOF quits)."""
    engine = _engine(model, device, dtype)
    tok = engine.loaded.tokenizer
    messages = [{"role": "system", "content": system}] if system else []
    typer.echo(f"kvtierd chat on {engine.loaded.name} ({engine.loaded.config.num_layers} layers, {device}); empty line quits.")
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        reply = _stream(engine, tok.encode_chat(messages), _params(max_tokens, temperature, 1.0, None))
        messages.append({"role": "assistant", "content": reply})


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":
    main()
