"""The /metrics of a server of several models (floe.server.models): a prometheus_client collector."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from floe.server.models.served import ServedModel


class ModelMetrics:
    """The router's /metrics (a prometheus_client collector of `models()`): each model's state (loaded,
    load time, loads, sessions, tokens: floe_model_*), and each loaded model's core metrics labelled
    `model`."""

    def __init__(self, models: Callable[[], Iterable[ServedModel]]) -> None:
        self.models = models

    def collect(self) -> Iterator[Metric]:
        models = list(self.models())
        families: dict[str, Metric] = {}
        for m in models:  # the cores' own (floe_ttft_seconds, ...), one family a name across models
            if (core := m.core) is not None:
                for family in core.metrics.registry.collect():
                    into = families.setdefault(family.name, Metric(family.name, family.documentation,
                                                                   family.type, family.unit))
                    into.samples += [s._replace(labels={"model": m.name, **s.labels}) for s in family.samples]
        yield from families.values()
        loaded = GaugeMetricFamily("floe_model_loaded", "Whether the model's engine is loaded",
                                   labels=["model"])
        load_s = GaugeMetricFamily("floe_model_load_seconds", "The model's last load (reading its weights, "
                                   "building and warming its engine and core)", labels=["model"])
        loads = CounterMetricFamily("floe_model_loads", "Times the model was loaded", labels=["model"])
        sessions = GaugeMetricFamily("floe_model_sessions", "The loaded model's sessions by state",
                                     labels=["model", "state"])
        tokens = CounterMetricFamily("floe_model_tokens", "Tokens of the model's answered requests, across "
                                     "its loads", labels=["model", "kind"])
        for m in models:
            core = m.core
            loaded.add_metric([m.name], float(core is not None))
            load_s.add_metric([m.name], m.load_seconds)
            loads.add_metric([m.name], m.loads)
            if core is not None:
                counts = core.store.counts()
                for state in ("live", "frozen"):
                    sessions.add_metric([m.name, state], counts[state])
            for kind, n in m.tokens.items():
                tokens.add_metric([m.name, kind], n)
        yield from (loaded, load_s, loads, sessions, tokens)
