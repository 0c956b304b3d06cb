"""Selection policies: InfiniGen and the baselines it is measured against, behind one interface."""

from __future__ import annotations

from infinigen.policies.base import Policy
from infinigen.policies.dense import DensePolicy
from infinigen.policies.full import FullPolicy
from infinigen.policies.h2o import H2OPolicy
from infinigen.policies.infinigen import InfiniGenPolicy
from infinigen.policies.oracle import OraclePolicy
from infinigen.policies.quest import QuestPolicy
from infinigen.policies.streaming import StreamingPolicy

REGISTRY: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        DensePolicy,
        FullPolicy,
        InfiniGenPolicy,
        H2OPolicy,
        StreamingPolicy,
        QuestPolicy,
        OraclePolicy,
    )
}


def policy_class(name: str) -> type[Policy]:
    if name == "int4":
        from infinigen.policies.int4 import Int4Policy  # needs the quantized tier

        return Int4Policy
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; available: {', '.join([*REGISTRY, 'int4'])}") from None


def make_policy(config, adapter, attachment=None) -> Policy:
    return policy_class(config.policy)(config, adapter, attachment)


__all__ = ["Policy", "make_policy", "policy_class"]
