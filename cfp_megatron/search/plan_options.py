"""The plan options a search chooses from a set the user allows: CUDA graphs (``cfp.constraints.cuda_graph_impl``),
the MoE token policy (``cfp.constraints.moe_token_policy``) and the flex dispatcher's backend
(``cfp.constraints.moe_flex_dispatcher_backend``). Each combination is searched whole, as each number
format is (:mod:`cfp_megatron.search.formats`), so the result is the exhaustive one's; the graphed ones first, whose
k-th best step time the others then prune with (graphs only remove launches). Without a set the job's own settings
are the one combination (docs/planning.md, "CUDA graphs and the MoE token policy")."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cfp_megatron.base.cfp_spec import CfpSpec
from cfp_megatron.base.config import CudaGraphImpl, FlexBackend, JobSpec, MoeTokenPolicy, Recompute, TokenDispatcher
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.layout_rules import graphs
from cfp_megatron.base.layout_rules.problem import issues as rule_issues
from cfp_megatron.base.parallel_dims import graph_model_problems
from cfp_megatron.search.space import Rejection

GRAPHS_KEY = "cfp.constraints.cuda_graph_impl"
POLICY_KEY = "cfp.constraints.moe_token_policy"
FACTOR_KEY = "cfp.constraints.moe_capacity_factor"
BACKEND_KEY = "cfp.constraints.moe_flex_dispatcher_backend"


@dataclass(frozen=True, kw_only=True)
class PlanOption:
    """One combination of the searched options."""

    graphs: CudaGraphImpl | None
    """The CUDA graph implementation; ``None``: the job's own (no set)."""
    policy: MoeTokenPolicy | None
    """The MoE token policy; ``None``: the model's own (no set)."""
    capacity: float | None = None
    """The capacity factor of a token-drop :attr:`policy`."""
    backend: FlexBackend | None = None
    """The flex dispatcher's backend; ``None``: the job's own (no set)."""

    @property
    def name(self) -> str:
        """What a person reads (``cuda_graph_impl=transformer_engine moe_token_policy=drop_pad(1.25)``)."""
        parts = [f"cuda_graph_impl={self.graphs.value}"] if self.graphs is not None else []
        if self.policy is not None:
            factor = f"({self.capacity:g})" if self.policy is not MoeTokenPolicy.dropless else ""
            parts.append(f"moe_token_policy={self.policy.value}{factor}")
        parts += [f"moe_flex_dispatcher_backend={self.backend.value}"] if self.backend is not None else []
        return " ".join(parts) or "the job's own"

    def apply(self, job: JobSpec) -> JobSpec:
        """``job`` with this combination's settings (the graphs' scope follows the token policy), checked as one
        job; :class:`ConfigError` where it refuses them (a policy the model does not run, DeepEP's drop-and-pad)."""
        model, parallel = job.model, job.parallel
        if self.policy is not None:
            dropless = self.policy is MoeTokenPolicy.dropless
            model = dataclasses.replace(model, moe_expert_capacity_factor=None if dropless else self.capacity,
                                        moe_pad_expert_input_to_capacity=self.policy is MoeTokenPolicy.drop_pad)
        if self.backend is not None:
            parallel = dataclasses.replace(parallel, moe_flex_dispatcher_backend=self.backend)
        if self.graphs is not None:
            scope = None
            if self.graphs is not CudaGraphImpl.none:
                scope = parallel.cuda_graph_scope or graphs.searched_scope(
                    moe=model.is_moe, drop_pad=model.moe_pad_expert_input_to_capacity,
                    dispatcher=model.moe_token_dispatcher.value)
            parallel = dataclasses.replace(parallel, cuda_graph_impl=self.graphs, cuda_graph_scope=scope)
        if model is job.model and parallel is job.parallel:
            return job
        return dataclasses.replace(job, model=model, parallel=parallel)

    def narrowed(self, cfp: CfpSpec, job: JobSpec) -> CfpSpec:
        """``cfp`` for the search of ``job`` under this combination (:meth:`apply`): per-layer CUDA graphs leave
        full recomputation out of the space (Megatron-Core runs it only in a whole-iteration graph:
        :func:`~cfp_megatron.base.layout_rules.graphs.with_recompute`); a combination without graphs searches it."""
        parallel = job.parallel
        if parallel.cuda_graph_impl is CudaGraphImpl.none or parallel.graph_scopes() == ("full_iteration",):
            return cfp
        kept = [r for r in (cfp.allowed("recompute") or list(Recompute)) if r is not Recompute.full]
        if not kept:  # the job's own graphs beside a pinned full recomputation
            raise ConfigError(rule_issues(graphs.with_recompute(parallel.graph_scopes(),
                                                                impl=parallel.cuda_graph_impl.value,
                                                                recompute=Recompute.full.value)))
        return dataclasses.replace(cfp, constraints=dataclasses.replace(cfp.constraints, recompute=kept))


@dataclass(frozen=True, kw_only=True)
class OptionOutcome:
    """What the search found for one combination of the options."""

    name: str
    """:attr:`PlanOption.name`."""
    best_s: float | None
    """Its fastest plan's step time in seconds; ``None`` where none entered the top k (provably slower than the k-th
    best of the combinations searched before it, or none fits)."""


def searched(cfp: CfpSpec) -> bool:
    """Whether ``cfp`` allows a set of either option."""
    c = cfp.constraints
    return c.cuda_graph_impl is not None or c.moe_token_policy is not None or c.moe_flex_dispatcher_backend is not None


def plan_options(job: JobSpec, cfp: CfpSpec, *, te_available: bool) -> tuple[list[PlanOption], list[Rejection]]:
    """The combinations the search tries for ``job``, graphed first, and the values of the sets left out with why
    (graphs where they cannot run; a policy the model's dispatcher does not run). Raises :class:`ConfigError` for a
    set of which nothing is left, a token policy on a dense model, or token-drop without a capacity factor."""
    c = cfp.constraints
    left: list[Rejection] = []
    impls: list[CudaGraphImpl | None] = [None]
    if c.cuda_graph_impl is not None:
        impls = []
        for impl in dict.fromkeys(c.cuda_graph_impl):
            why = graphs.runs(impl.value, on_cpu=job.cluster.on_cpu, te=te_available)
            if why is None:
                impls.append(impl)
            else:
                left.append(Rejection(what=f"cuda_graph_impl={impl.value}", reason=why))
        graphed = [i for i in impls if i is not CudaGraphImpl.none]
        if graphed and cfp.allowed("recompute") == [Recompute.full]:  # the pin or set keeps per-layer graphs out
            why = "per-layer CUDA graphs do not run with full recomputation (Megatron-Core), the only one allowed"
            if CudaGraphImpl.none not in impls:
                raise ConfigError(ConfigIssue(key=GRAPHS_KEY, value=[i.value for i in c.cuda_graph_impl],
                                              problem=f"allows only CUDA graphs: {why}.",
                                              fix="add none to the set, or allow selective recomputation."))
            left += [Rejection(what=f"cuda_graph_impl={i.value}", reason=why) for i in graphed]
            impls = [CudaGraphImpl.none]
        if not impls and job.cluster.on_cpu:
            impls = [CudaGraphImpl.none]  # CUDA graphs are ignored on CPU (one note), as a pinned one is
        elif not impls:
            raise ConfigError(ConfigIssue(key=GRAPHS_KEY, value=[i.value for i in c.cuda_graph_impl],
                                          problem="leaves nothing that runs here: " + "; ".join(
                                              f"{r.what}: {r.reason}" for r in left) + ".",
                                          fix="add none or local to the set, or install transformer-engine."))
        impls.sort(key=lambda i: i is CudaGraphImpl.none)  # graphed first: they prune the others
    backends: list[FlexBackend | None] = [None]
    if c.moe_flex_dispatcher_backend is not None:
        backends = list(_backends(job, cfp))
    policies: list[PlanOption] = [PlanOption(graphs=None, policy=None)]
    if c.moe_token_policy is not None:
        policies = _policies(job, cfp, left, backends)
    pairs = []
    for policy in policies:  # a policy one backend of the set runs and another does not (DeepEP's drop-and-pad)
        for backend in backends:
            option = dataclasses.replace(policy, backend=backend)
            try:
                option.apply(job)
            except ConfigError as err:
                left.append(Rejection(what=option.name, reason=err.issues[0].problem))
                continue
            pairs.append(option)
    options = [dataclasses.replace(p, graphs=impl) for p in pairs for impl in impls]
    for option in options:  # a scope the model refuses (the job's own, or the user's beside a set): said once, now
        issues = rule_issues(graph_model_problems(option.apply(job)))
        if issues:
            raise ConfigError(issues)
    return options, left


def _backends(job: JobSpec, cfp: CfpSpec) -> list[FlexBackend]:
    """The flex backends of the set; :class:`ConfigError` for a job without the flex dispatcher, which runs none."""
    allowed = list(dict.fromkeys(cfp.constraints.moe_flex_dispatcher_backend or []))
    m = job.model
    if not m.is_moe or m.moe_token_dispatcher is not TokenDispatcher.flex:
        raise ConfigError(ConfigIssue(key=BACKEND_KEY, value=[b.value for b in allowed],
                                      problem="chooses the flex dispatcher's kernels, and model "
                                              f"{m.name} runs " + (f"the {m.moe_token_dispatcher.value} dispatcher."
                                                                   if m.is_moe else "no experts."),
                                      fix=f"set model.moe_token_dispatcher=flex, or {BACKEND_KEY}=null."))
    return allowed


def _policies(job: JobSpec, cfp: CfpSpec, left: list[Rejection],
              backends: list[FlexBackend | None]) -> list[PlanOption]:
    """The token policies of the set that the model runs under one of the flex ``backends`` at least (``None``: the
    job's own); those it refuses under each added to ``left``."""
    allowed = [p.value for p in cfp.constraints.moe_token_policy]
    if not job.model.is_moe:
        raise ConfigError(ConfigIssue(key=POLICY_KEY, value=allowed, problem=f"sets how MoE layers drop tokens, "
                                      f"and model {job.model.name} has no experts (model.num_experts is null).",
                                      fix=f"set {POLICY_KEY}=null for a dense model."))
    factor = cfp.constraints.moe_capacity_factor or job.model.moe_expert_capacity_factor
    kept = []
    for policy in dict.fromkeys(cfp.constraints.moe_token_policy):
        if policy is not MoeTokenPolicy.dropless and factor is None:
            raise ConfigError(ConfigIssue(key=FACTOR_KEY, value=None, problem=f"is needed: {POLICY_KEY} allows "
                                          f"{policy.value}, and model.moe_expert_capacity_factor is null (dropless).",
                                          fix=f"set {FACTOR_KEY}=1.0 (or another capacity factor), or keep "
                                              f"{POLICY_KEY}=[dropless]."))
        option = PlanOption(graphs=None, policy=policy, capacity=None if policy is MoeTokenPolicy.dropless
                            else factor)
        refused = []
        for backend in backends:
            try:
                dataclasses.replace(option, backend=backend).apply(job)
            except ConfigError as err:
                refused.append(err.issues[0].problem)
        if len(refused) == len(backends):
            left.append(Rejection(what=f"moe_token_policy={policy.value}", reason=refused[0]))
            continue
        kept.append(option)
    if not kept:
        raise ConfigError(ConfigIssue(key=POLICY_KEY, value=allowed, problem="leaves no policy the model runs: "
                                      + "; ".join(f"{r.what}: {r.reason}" for r in left),
                                      fix="add dropless to the set."))
    return kept


def option_index(job: JobSpec, options: list[PlanOption]) -> int:
    """The index in ``options`` of ``job``'s combination."""
    policy, impl, backend = MoeTokenPolicy.of(job.model), job.parallel.cuda_graph_impl, \
        job.parallel.moe_flex_dispatcher_backend
    return next((i for i, o in enumerate(options) if o.policy in (None, policy) and o.graphs in (None, impl)
                 and o.backend in (None, backend)), 0)


def tie_order(job: JobSpec, options: list[PlanOption]) -> tuple[int, bool]:
    """How ``job``'s combination ranks on a tie of step times: the set's token policies in their order, then
    without graphs before graphed (the same time for less memory)."""
    policies = list(dict.fromkeys(o.policy for o in options))
    policy = MoeTokenPolicy.of(job.model)
    return (policies.index(policy) if policy in policies else 0,
            job.parallel.cuda_graph_impl is not CudaGraphImpl.none)


def option_reason(outcomes: list[OptionOutcome], chosen: str, chosen_s: float) -> str:
    """One sentence on the combination of the plan the search chose (``chosen_s`` its step time): against each other
    combination's best (and its own best, where the choice ran another of its plans: :mod:`cfp_megatron.search.
    choice`)."""
    others = [f"{o.name} {o.best_s:.4g} s" if o.best_s is not None else f"{o.name} slower (pruned by the bound)"
              for o in outcomes if o.name != chosen]
    own = next((o.best_s for o in outcomes if o.name == chosen), None)
    mine = f": the chosen plan {chosen_s:.4g} s per step" + (
        f" (its fastest {own:.4g} s)" if own is not None and own < chosen_s else "")
    return (f"{chosen} chosen from [{', '.join(o.name for o in outcomes)}]" + mine
            + (f"; {', '.join(others)}" if others else ""))


def option_label(job: JobSpec, options: tuple[PlanOption, ...] | list[PlanOption]) -> str:
    """What a plan's label adds for the searched options (`` drop_pad cg=local``): the token policy and the graphs
    of ``job`` where the search chose them from a set (``options``: :attr:`SearchResult.option_choices`), else
    nothing."""
    out = ""
    if any(o.policy is not None for o in options):
        out += f" {MoeTokenPolicy.of(job.model).value}"
    if any(o.graphs is not None for o in options) and job.parallel.cuda_graph_impl is not CudaGraphImpl.none:
        out += f" cg={job.parallel.cuda_graph_impl.value}"
    return out

