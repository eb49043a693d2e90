"""The service's defaults and its routes' help, in a module that imports nothing.

`hepti --help` (and every command: the parser is built whole) shows them, and importing them from
hepti.serve.http or hepti.serve.stall pulled in numpy, the kernels (Numba) and the planner
(scipy.optimize): about 1.2 s of CPU on every start of every process, every rank of an mpiexec
job included. Those modules import them from here.
"""

# A request's body must arrive whole within this many seconds of its headers, else 408 and the
# connection closes: a client that announces more than it sends (or trickles it) holds a thread
# only this long. 8 MiB (the default --max-body-bytes) takes ~7 s at 10 Mbit/s. --read-timeout.
READ_TIMEOUT_S = 10.0

# The least any batch gets before a silent rank in it is declared lost. Above LATE_AFTER_S
# (3 s: six beats missed), so a rank is late, and named by /health, for a moment before it is
# lost; low enough that the first answer after a SIGSTOP comes within the 10 s. On one
# machine the relaunch takes the spare job (hepti.serve.supervisor), so it costs a first batch:
# `python -m hepti.bench.stall --runs 5` at load averages 10.9-14.2 on this shared 2-core
# machine (2026-11-29): declared 4.04-4.36 s after the stop, first answer 4.09-4.39 s (median
# 4.20); without the spare (`--spare off`, or a hostfile) 6.97-16.2 s (median 8.1, 3 of 5
# within 10 s), where a fresh start's 1.5 s of CPU (imports 0.7, kernels 0.6, weights 0.2:
# `--stages`) takes 4-19 s of wall. Lowering the floor would buy at most its own difference,
# and a rank starved of CPU for 3-4 s on a machine this loaded would then be taken for hung.
# `hepti serve --stall-floor S` sets it; 0 turns the handling off (late ranks are only named).
STALL_FLOOR_S = 4.0

ROUTES_HELP = """\
routes:
  POST /v1/embeddings   embed texts or token ids (also POST /embeddings); OpenAI's shape
  GET  /health          200 {"status": "ok", ...} when the workers are up, else 503 with why:
                        "starting", "relaunching", "failed", or "degraded" (a rank silent for
                        seconds: hung, starved or cut off; named in "late"; past its batch's
                        deadline it is declared lost, and its device listed in "lost" until
                        it answers again). No API key needed
  GET  /metrics         plan epoch, ranks' shares and predicted and measured times, each rank's
                        seconds since its last heartbeat, the stall deadline and the lost
                        devices' probes, latencies, re-plans and flags with their reasons,
                        each rank's detector bounds (with --replan on; JSON)

A text encoder answers POST /v1/embeddings; a decoder (a Llama-style model) answers
POST /v1/completions and POST /v1/chat/completions instead, one generation at a time (the
others wait in the queue in arrival order), each token streamed back as it is made.

embeddings request:  {"input": "text" | ["text", ...] | [id, ...] | [[id, ...], ...],
           "encoding_format": "float" | "base64",   (optional; base64: little-endian float32)
           "truncate": false,   (true: cut inputs longer than the model takes instead of 413)
           "dimensions": C, "model": "...", "user": "..."}   (optional; model is ignored)
answer:   {"object": "list", "model": "NAME", "usage": {"prompt_tokens": N, "total_tokens": N},
           "data": [{"object": "embedding", "index": 0, "embedding": [0.0123, ...]}, ...]}
errors:   {"error": {"message": "...", "type": "invalid_request_error", "code": "..."}}

example:
  curl -s http://127.0.0.1:8080/v1/embeddings -H 'Content-Type: application/json' \\
       -d '{"input": ["A cat sat.", "A dog sat."]}'

completions (a decoder):
  POST /v1/completions  {"prompt": "text", "max_tokens": 16, "temperature": 1.0, "top_p": 1.0,
                         "seed": 0, "stream": false, "stop": "text" | ["text", ...]}
        -> {"object": "text_completion", "choices": [{"index": 0, "text": "...",
            "finish_reason": "stop" | "length"}], "usage": {"prompt_tokens",
            "completion_tokens", "total_tokens"}, "id", "created", "model"}
  POST /v1/chat/completions  {"messages": [{"role": "user", "content": "..."}], ...as above;
                              max_tokens defaults to 256}, rendered by the model's chat template
        -> {"object": "chat.completion", "choices": [{"index": 0, "message": {"role":
            "assistant", "content": "..."}, "finish_reason": ...}], "usage": {...}}
  "temperature": 0 is greedy; "stream": true answers text/event-stream, one "data: {chunk}"
  event per token that adds text ("text_completion" chunks with choices[0].text, or
  "chat.completion.chunk" with choices[0].delta.content, the first carrying delta.role), a
  last chunk with the finish reason, then "data: [DONE]". A client that disconnects stops its
  generation. A prompt and max_tokens beyond the model's context get 400.
  curl -s http://127.0.0.1:8080/v1/completions -H 'Content-Type: application/json' \\
       -d '{"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0}'
  curl -sN http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"messages": [{"role": "user", "content": "What is the capital of France?"}],
            "stream": true}'
"""
