"""The training service: ``python -m trainer serve``, a Tinker-protocol front door to the same
workers, losses and deadlines as ``python -m trainer`` (DESIGN 8; docs/tinker.md).

One trio process owns the sessions, the models and the futures; each model's operations run in
the order its client numbered them, each under ``serve.request_timeout_s``, in a thread.
Private modules: ``_cli`` (the subcommand), ``_app`` (the routes), ``_models`` (a model and
its ordered operations), ``_futures`` (the futures ``retrieve_future`` answers), ``_proto``
(the protobuf messages of ``forward_backward``, read and written by hand), ``_http`` (what
every route shares), ``_checkpoints`` (``tinker://`` checkpoints), ``_sessions`` (sessions
that end), ``_sampling`` (sampler saves through the trainer's verified adapter sync, sampling
sessions, samples), ``_engine`` (the sampling engines: a reference-engine server per base
model, started on first use, stopped with the service), ``_sample_io`` (a ``SampleRequest``
read, the protobuf ``SampleResponse`` written).
"""

from trainer.serve._app import API as API
from trainer.serve._app import ServiceApp as ServiceApp
from trainer.serve._app import ServiceSpec as ServiceSpec
from trainer.serve._cli import READY_PREFIX as READY_PREFIX
from trainer.serve._cli import serve as serve
from trainer.serve._cli import serve_main as serve_main
from trainer.serve._cli import spec_of as spec_of

__all__ = ["API", "READY_PREFIX", "ServiceApp", "ServiceSpec", "serve", "serve_main", "spec_of"]
