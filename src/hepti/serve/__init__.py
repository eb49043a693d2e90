"""`hepti serve`: an embeddings (or, for a decoder, completions) service in front of a
long-lived MPI job.

- supervisor: the request queue, the batcher, and the workers' launches and relaunches;
- worker: the MPI side, every rank (`python -m hepti.serve.worker`); generation: its part for
  a decoder (one generation at a time, a token a frame);
- protocol: the framed channel between the front end and rank 0;
- requests and http: the HTTP routes and their checks, and the --jsonl mode.
"""
from hepti.errors import HeptiError


class ServiceUnavailable(HeptiError):
    """The workers are down and not coming back, or an answer did not come in time."""
