"""`hepti serve`: start the workers, then answer HTTP (or --jsonl) until stopped."""
from __future__ import annotations

import ipaddress
import logging
import os
import signal
import sys
import threading

from hepti.errors import InputError
from hepti.families import family
from hepti.plan.planfile import parse_ratios
from hepti.serve.http import make_server, serve_jsonl
from hepti.serve.listen import listening_socket
from hepti.serve.requests import Limits
from hepti.serve.supervisor import Supervisor
from hepti.weights import WeightStore

log = logging.getLogger("hepti")
API_KEY_ENV = "HEPTI_API_KEY"


def worker_args(args) -> list[str]:
    """The flags every worker rank gets (hepti.serve.worker's)."""
    out = ["--threads", str(args.threads), "--plan-seq", str(args.plan_seq),
           "--plan-batch", str(args.plan_batch), "--pool", args.pool,
           "--normalize", "0" if args.no_normalize else "1"]
    strategy = args.strategy or ("single" if args.n == 1 else "auto")
    if not args.plan:
        out += ["--strategy", strategy]
    for flag in ("ratios", "plan", "profile", "mem_cap", "mem_budget"):
        value = getattr(args, flag)
        if value:
            out += ["--" + flag.replace("_", "-"), str(value)]
    return out


def api_key(args) -> str | None:
    """The key clients must send: --api-key-file's first line (stripped), --api-key (with a
    warning: the command line is public), else $HEPTI_API_KEY, else None (no key)."""
    path = args.api_key_file
    if path:
        fix = (f"write the key on its first line, e.g. `openssl rand -hex 32 > {path} && "
               f"chmod 600 {path}`")
        try:
            with open(path, encoding="utf-8-sig") as f:  # -sig: a BOM is not part of the key
                first = f.readline().strip()
        except FileNotFoundError:
            raise InputError(f"--api-key-file {path}: no such file; {fix}") from None
        except IsADirectoryError:
            raise InputError(f"--api-key-file {path}: is a directory, not a file; {fix}") from None
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
            raise InputError(f"--api-key-file {path}: cannot read it ({why}); make it readable "
                             f"by this user, or {fix}") from None
        if not first:
            raise InputError(f"--api-key-file {path}: its first line is empty; {fix}")
        return first
    if args.api_key:
        log.warning("--api-key puts the key on the command line, where every user of this "
                    "machine can read it (ps, /proc/PID/cmdline); give it in a file "
                    "(--api-key-file FILE) or in $%s instead", API_KEY_ENV)
        return args.api_key
    return os.environ.get(API_KEY_ENV) or None


def check_args(args, key: str | None = None) -> None:
    """What would fail only once the workers run: say it now."""
    if not args.stall_floor >= 0:
        raise InputError(f"--stall-floor {args.stall_floor:g}: give the least seconds a batch "
                         "gets before a silent rank is declared lost, or 0 for never")
    if not args.read_timeout > 0:
        raise InputError(f"--read-timeout {args.read_timeout:g}: give the seconds a request's "
                         "body may take to arrive, above 0")
    if args.plan and (args.strategy or args.ratios):
        raise InputError("--plan already sets the strategy and ratios; drop --strategy/--ratios")
    for flag in ("plan", "profile", "hostfile"):
        path = getattr(args, flag)
        if path and not os.path.isfile(path):
            raise InputError(f"--{flag} {path}: no such file")
    cfg = WeightStore(args.model).config
    fam = family(cfg)
    if "pixels" in fam.inputs:
        raise InputError(f"{args.model} is a vision model; hepti serve embeds texts and token "
                         "ids (use `hepti run --image` for images)")
    if fam.executor == "decoder":
        _check_decoder_args(args)
    elif fam.executor != "interpreter":
        raise InputError(f"{args.model} is a {fam.label} {fam.executor} ({cfg.model_type}); "
                         "hepti serve runs text encoders and decoders")
    if not _loopback(args.host) and not key:
        log.warning("serving on %s without an API key (--api-key-file or $%s): anyone who "
                    "reaches this address can use the service", args.host, API_KEY_ENV)


def _check_decoder_args(args) -> None:
    """A decoder is served in `tensor` over all ranks by --ratios or equal shares
    (hepti.serve.generation), over HTTP: the planner's and the batcher's flags do not apply."""
    if args.jsonl:
        raise InputError(f"--jsonl answers embeddings requests; {args.model} is a decoder: "
                         "serve it over HTTP (POST /v1/completions)")
    if args.replan == "on":
        raise InputError("--replan on re-plans encoders; a decoder keeps its shares (drop it)")
    for flag in ("plan", "profile", "mem_cap", "mem_budget"):
        if getattr(args, flag):
            raise InputError(f"--{flag.replace('_', '-')}: a decoder is served in tensor by "
                             "--ratios or equal shares; drop it")
    if args.strategy not in (None, "auto", "tensor", "pipeline") and not (
            args.strategy == "single" and args.n == 1):
        raise InputError(f"--strategy {args.strategy}: a decoder is served in tensor over "
                         "all its ranks, or in pipeline (drop --strategy, or serve it with -n 1)")
    if args.ratios:
        parse_ratios(args.ratios, args.n)  # one share per rank: said now, not by the workers


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run(args) -> int:

    key = api_key(args)
    check_args(args, key)
    limits = Limits(max_body_bytes=args.max_body_bytes, max_inputs=args.max_inputs,
                    max_request_tokens=args.max_request_tokens)
    sock = None if args.jsonl else listening_socket(args.host, args.port)  # before any launch
    sup = Supervisor(args.model, args.n, hostfile=args.hostfile, worker_args=worker_args(args),
                     max_batch_tokens=args.max_batch_tokens, max_batch_inputs=args.max_batch_inputs,
                     request_timeout_s=args.request_timeout, stall_floor_s=args.stall_floor,
                     replan=args.replan == "on" and args.n > 1,
                     replan_ab=args.replan_ab, spare=args.spare == "on").start()
    try:
        if args.jsonl:
            errors = serve_jsonl(sup, sys.stdin.buffer, sys.stdout, limits, log)
            if errors:
                log.error("%d request(s) were answered with an error (their lines say why)", errors)
            return 1 if errors else 0
        server = make_server(sup, api_key=key, limits=limits, sock=sock, log=log,
                             read_timeout_s=args.read_timeout)
        host, port = server.server_address[:2]
        print(f"hepti serve: listening on http://{host}:{port} (model {sup.name}, "
              f"{args.n} rank(s)); GET /health says when the workers are ready; Ctrl-C stops",
              file=sys.stderr, flush=True)

        def stop(signum, frame):
            threading.Thread(target=server.shutdown, daemon=True).start()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, stop)
        server.serve_forever(poll_interval=0.2)
        server.server_close()
        print("hepti serve: stopped", file=sys.stderr, flush=True)
        return 0
    finally:
        sup.stop()
        if sock is not None:
            sock.close()
