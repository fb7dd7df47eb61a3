"""``verispec serve --replicas``: the launch. Checks what a user can get wrong (Ray missing, the
scaling options, the model references, a damaged datastore) before Ray starts, then hands over to
:func:`verispec.server.replicas.run_replicas`, which owns the replicas themselves."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from verispec.cli.common import err
from verispec.errors import InvalidParameterError
from verispec.server.app import ServerConfig
from verispec.server.replicas import ReplicaSpec, ScalingOptions, import_serve, run_replicas

DEFAULT_MAX_NUM_SEQS = 8  # ServerConfig's batch when max_num_seqs is None


@dataclass(frozen=True)
class ReplicaOptions:
    """The ``--replicas`` family of ``verispec serve`` flags; any of them but ``replica_cpus``
    given means serving on Ray Serve (:attr:`requested`).

    Attributes:
        replicas: replicas when not autoscaling (None: 1).
        ray_address: a Ray cluster to join; None starts one on this machine.
        min_replicas, max_replicas, target_ongoing_requests: Ray Serve autoscaling
            (:class:`ScalingOptions`).
        replica_cpus: CPUs per replica; None: this machine's cores shared by the first replicas,
            1 on a cluster.
        ray_temp_dir: where a local Ray cluster keeps its files (None: ``$VERISPEC_HOME/ray``).
    """

    replicas: int | None = None
    ray_address: str | None = None
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    replica_cpus: float | None = None
    ray_temp_dir: str | None = None

    @property
    def requested(self) -> bool:
        flags = (self.replicas, self.ray_address, self.min_replicas, self.max_replicas, self.target_ongoing_requests)
        return any(v is not None for v in flags)

    def scaling(self, config: ServerConfig) -> ScalingOptions:
        """The deployment's scaling, Ray sending a replica at most its queue plus its batch.

        Raises:
            InvalidParameterError: a bound or count out of range.
        """
        num_replicas = 1 if self.replicas is None else self.replicas
        cpus = self.replica_cpus
        if cpus is None:  # this machine's cores shared by the first replicas; 1 on a cluster
            first = num_replicas if self.min_replicas is None else max(1, self.min_replicas)
            cpus = 1.0 if self.ray_address else float(max(1, (os.cpu_count() or 1) // max(1, first)))
        return ScalingOptions(
            num_replicas=num_replicas,
            min_replicas=self.min_replicas,
            max_replicas=self.max_replicas,
            target_ongoing_requests=self.target_ongoing_requests,
            num_cpus=cpus,
            max_ongoing_requests=config.max_queue + (config.max_num_seqs or DEFAULT_MAX_NUM_SEQS),
        )


def serve_replicas(spec: ReplicaSpec, options: ReplicaOptions, *, host: str, port: int) -> int:
    """Serve ``spec`` on Ray Serve replicas at ``host:port`` until SIGTERM or SIGINT, then shut them
    and Ray down; returns that signal's number. The built-in models are fetched here, once for
    every replica on this machine, and local paths made absolute (a replica's working directory is
    Ray's, not this shell's).

    Raises:
        VerispecError: Ray Serve missing, bad scaling options, ``--ray-temp-dir`` with
            ``--ray-address`` or unusable, a model reference that resolves to nothing, a damaged
            datastore, or replicas that did not start.
    """
    from verispec.models.store import ModelStore
    from verispec.proposers.datastore import Datastore
    from verispec.server.ray_session import ray_temp_dir

    import_serve()
    scaling = options.scaling(spec.config)
    if options.ray_address and options.ray_temp_dir is not None:
        raise InvalidParameterError("--ray-temp-dir is for a cluster this command starts, not with --ray-address")
    temp_dir, notice = (None, None) if options.ray_address else ray_temp_dir(options.ray_temp_dir)
    if notice is not None:
        err.print(f"[yellow]note:[/yellow] {notice}", highlight=False)
    store = ModelStore()
    for ref in (spec.target, spec.draft):
        if ref is not None:
            with err.status(f"resolving {ref}"):
                store.resolve(ref)
    drafters = spec.drafters
    if drafters.datastore is not None:
        Datastore(drafters.datastore)
    drafters = dataclasses.replace(
        drafters, datastore=_resolved(drafters.datastore), eagle_head=_resolved(drafters.eagle_head)
    )
    spec = dataclasses.replace(spec, target=_absolute(spec.target), draft=_absolute(spec.draft), drafters=drafters)
    return run_replicas(spec, scaling, host=host, port=port, ray_address=options.ray_address, ray_temp_dir=temp_dir)


def _resolved(path: str | Path | None) -> str | None:
    """A local path as an absolute one (a replica's working directory is Ray's)."""
    return None if path is None else str(Path(path).resolve())


def _absolute(ref: str | None) -> str | None:
    return str(Path(ref).expanduser().resolve()) if ref is not None and Path(ref).expanduser().exists() else ref
