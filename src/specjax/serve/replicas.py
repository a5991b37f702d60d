"""Data parallelism for serving: M engine replicas (each an EngineService with its own engine on its own device
group) behind one API.  A request goes to the replica with the fewest unfinished requests; /metrics carries
every replica's series with a `replica` label (sum them for the total), /health each replica's load and the
totals."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, ProcessCollector, generate_latest
from prometheus_client.metrics_core import Metric

from specjax.sampling import SamplingParams
from specjax.serve.service import EngineService, RequestState

SHARED = ("process_", "specjax_rejected_requests")  # process-wide series, reported once, without a replica label


class _ReplicaSeries:
    """A prometheus collector yielding each replica registry's specjax_* families, samples labelled by replica."""

    def __init__(self, services: list[EngineService]):
        self.services = services

    def collect(self):
        families: dict[str, Metric] = {}
        for i, service in enumerate(self.services):
            service.metrics.set_programs(service.engine.programs)
            for family in service.metrics.registry.collect():
                if family.name.startswith(SHARED):
                    continue
                merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                                 family.unit))
                merged.samples += [s._replace(labels={**s.labels, "replica": str(i)}) for s in family.samples]
        yield from families.values()


class DataParallelService:
    """The EngineService interface the API uses (submit, abort, validate_request, health, metrics_text, error)
    over several replicas."""

    def __init__(self, services: list[EngineService]):
        if not services:
            raise ValueError("DataParallelService needs at least one replica")
        self.services = services
        self.tokenizer = services[0].tokenizer
        self.max_model_len = services[0].max_model_len  # every replica has the same model and limits
        self.registry = CollectorRegistry()
        self.rejected = Counter("specjax_rejected_requests", "Requests rejected with HTTP 400", registry=self.registry)
        self.registry.register(_ReplicaSeries(services))
        ProcessCollector(registry=self.registry)

    @property
    def error(self) -> BaseException | None:
        return next((s.error for s in self.services if s.error is not None), None)

    def start(self) -> None:
        for s in self.services:
            s.start()

    def stop(self) -> None:
        for s in self.services:
            s.stop()

    def validate_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.services[0].validate_request(prompt_ids, params)  # every replica has the same model and limits

    def submit(self, prompt_ids: list[int], params: SamplingParams, stop: tuple[str, ...] = (),
               after: RequestState | None = None) -> RequestState:
        """To the replica with the fewest unfinished requests; n > 1 siblings (`after`) to their first's."""
        if after is not None:
            return after.owner.submit(prompt_ids, params, stop, after)
        least = min(self.services, key=lambda s: s.outstanding())
        return least.submit(prompt_ids, params, stop)

    def abort(self, state: RequestState) -> None:
        state.owner.abort(state)

    def health(self) -> dict:
        replicas = [s.health() for s in self.services]
        total = {key: sum(r[key] for r in replicas) for key in ("running", "waiting", "kv_pages_used")}
        programs = {key: sum(r["step_programs"][key] for r in replicas) for key in ("ready", "compiling", "evicted")}
        return {"step_programs": programs, **total, "replicas": replicas}

    def count_rejected(self) -> None:
        self.rejected.inc()

    def metrics_text(self) -> bytes:
        return generate_latest(self.registry)
