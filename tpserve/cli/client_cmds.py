"""`tpserve generate`, `tpserve profile` and `tpserve keys`: a prompt through a running daemon, a
profiler trace of it, and CurveZMQ key pairs.

Light: the client library and SamplingParams (numpy, zmq, msgpack), nothing of the server or
the engine.
"""
from __future__ import annotations

import sys

import click

from tpserve.cli.common import CONTEXT, client_options, connect, fail
from tpserve.client import protocol as P
from tpserve.client.client import ClientTimeout, RequestError
from tpserve.client.keys import KeyFileError, generate_keypair, load_public_key
from tpserve.errors import InvalidFieldError
from tpserve.sampling import SamplingParams


# ---- profile -----------------------------------------------------------------------------
@click.command(context_settings=CONTEXT)
@click.option("--seconds", type=click.FloatRange(0.0, P.MAX_PROFILE_SECONDS, min_open=True), default=5.0,
              show_default=True, help="how long to record")
@client_options(timeout=60.0)
def profile(seconds, **kw):
    """Record a torch profiler trace of every rank while the daemon serves.

    Prints the trace files (Chrome trace JSON, one per rank, in the daemon's runtime dir);
    open them in Perfetto or chrome://tracing. --timeout counts after --seconds.
    """
    with connect(kw) as client:
        try:
            files = client.profile(seconds)
        except ClientTimeout as e:
            fail(str(e))
        except RequestError as e:
            fail(f"profiling failed: {e}")
    for f in files:
        click.echo(f)


# ---- generate ----------------------------------------------------------------------------
@click.command(context_settings=CONTEXT)
@click.argument("prompt")
@click.option("--max-tokens", type=click.IntRange(min=1), default=SamplingParams.max_tokens,
              show_default=True,
              help="most tokens to generate")
@click.option("--temperature", type=float, default=SamplingParams.temperature, show_default=True,
              help="0 for greedy decoding")
@click.option("--top-p", type=float, default=SamplingParams.top_p, show_default=True,
              help="nucleus sampling: smallest token set with this probability mass (1 disables)")
@click.option("--top-k", type=int, default=SamplingParams.top_k, show_default=True,
              help="sample among the k most likely tokens (-1 disables)")
@click.option("--seed", type=int, default=None, help="make the sampled output reproducible")
@click.option("--stop", multiple=True, help="stop string (repeatable)")
@click.option("--stop-token-id", type=int, multiple=True, help="stop token id (repeatable)")
@click.option("--ignore-eos", is_flag=True, help="keep generating past the end-of-sequence token")
@click.option("--no-stream", is_flag=True, help="print the completion once it is finished")
@click.option("--show-finish", is_flag=True, help="print finish reason and token counts to stderr")
@click.option("--priority", type=int, default=None,
              help="lower is served first (a daemon started with --scheduling-order priority)")
@click.option("--request-timeout", type=float, default=None, metavar="SECONDS",
              help="the daemon ends the request after this many seconds (finish_reason timeout)")
@client_options(timeout=30.0)
def generate(prompt, max_tokens, temperature, top_p, top_k, seed, stop, stop_token_id, ignore_eos,
             no_stream, show_finish, priority, request_timeout, **kw):
    """Send PROMPT ('-' reads standard input) to the daemon and print the completion as it streams."""
    if prompt == "-":
        prompt = sys.stdin.read()
    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                max_tokens=max_tokens, stop=list(stop), stop_token_ids=list(stop_token_id),
                                ignore_eos=ignore_eos)
    except InvalidFieldError as e:
        option = e.field.split("[")[0]
        option = {"stop_token_ids": "stop-token-id"}.get(option, option.replace("_", "-"))
        raise click.BadParameter(e.reason, param_hint=f"'--{option}'") from None
    with connect(kw) as client:
        try:
            extra = dict(priority=priority, request_timeout=request_timeout)
            if no_stream:
                result = client.generate(prompt, params, **extra)
                click.echo(result.text)
            else:
                with client.stream(prompt, params, **extra) as stream:  # Ctrl-C aborts the request
                    for delta in stream:
                        click.echo(delta.text, nl=False)
                        sys.stdout.flush()
                click.echo()
                result = stream.result
        except ClientTimeout as e:
            fail(str(e))
        except (RequestError, P.ProtocolError) as e:
            fail(f"request failed: {e}")
    if show_finish:
        click.echo(f"[finish_reason={result.finish_reason} prompt_tokens={result.prompt_tokens} "
                   f"completion_tokens={result.completion_tokens}]", err=True)
    if result.finish_reason == "abort":
        fail(f"the request was aborted ({result.abort_reason or 'by the daemon'})")


# ---- keys --------------------------------------------------------------------------------
@click.command(context_settings=CONTEXT)
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--name", default="tpserve", show_default=True,
              help="file name stem: NAME.key, NAME.key_secret")
@click.option("--force", is_flag=True, help="overwrite existing key files")
def keys(directory, name, force):
    """Generate a CurveZMQ key pair into DIRECTORY.

    NAME.key holds the public key (give it to the other side); NAME.key_secret holds both keys
    (mode 0600; pass it to `tpserve start --curve-secret-key`, or a client's --client-key).
    """
    try:
        public_path, secret_path = generate_keypair(directory, name, force)
    except (KeyFileError, OSError) as e:
        fail(str(e))
    click.echo(f"public key: {public_path}")
    click.echo(f"secret key: {secret_path}")
    click.echo(f"public key (Z85): {load_public_key(public_path).decode()}")

