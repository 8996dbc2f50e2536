"""``/route``'s decision and the state it reads and writes, in one owner.

:class:`Routing` holds the in-flight ledger (with the session homes), the speculative
entries, the outlier detector, the router's tie-breaking state and the decision counts.
The HTTP layer gathers a request's :class:`IndexView` (tokens, keys, matches, doubts),
calls :meth:`Routing.decide` once and renders the :class:`Routed` it gets back; a route's
first token and end come back through :meth:`Routing.first_token` and
:meth:`Routing.done`. A decision never waits: it reads the ledger and enters itself in
it without yielding, so concurrent requests see each other's routes.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from kvindex.events.errors import Unavailable
from kvindex.events.wire.identity import member_pod
from kvindex.scoring.load import LoadView, PodLoad, Unknown
from kvindex.scoring.route.decision import SESSION_FALLBACKS, Decision, Reason, Router
from kvindex.scoring.route.doubt import credits_prefix, discredit
from kvindex.scoring.route.event_lag import EventLag
from kvindex.scoring.route.inflight import InFlight, InFlightLedger
from kvindex.scoring.route.one_pass import Pass, RowMaker, one_pass
from kvindex.scoring.route.outlier import Outcome, OutlierDetector
from kvindex.scoring.route.pd import Role, decide_pd, disaggregated, of_role
from kvindex.scoring.route.speculative import SpeculativeIndex, annotate
from kvindex.scoring.route.targets import Target, build_targets
from kvindex.scoring.scorer import PodScore, ScoreResult

R = TypeVar("R")

_PREFILL = "#prefill"  # the ledger id of a P/D route's prefill share


class RouteAsk(Protocol):
    """What a decision reads from the request itself (``/route``'s body has these)."""

    @property
    def model(self) -> str: ...
    @property
    def request_id(self) -> str | None: ...
    @property
    def max_tokens(self) -> int | None: ...
    @property
    def role(self) -> str | None: ...
    @property
    def session_id(self) -> str | None: ...


@dataclass(slots=True)
class IndexView:
    """What the index says about a request, or why it cannot say (``fallback``).
    A decision takes it over: it drops discredited and restarted members' matches and
    adds its own warnings."""

    prompt_tokens: int
    keys: list[int] = field(default_factory=list)
    matches: dict[str, PodScore] = field(default_factory=dict)
    fallback: Reason | None = None
    warnings: list[str] = field(default_factory=list)
    doubts: dict[str, str] = field(default_factory=dict)  # pod -> why its entries are doubted
    # The lookup's answer, for the speculative entries: annotated by the decision.
    result: ScoreResult | None = None


class NoRoom(Exception):
    """No candidate is admissible; ``refused`` says why, pod by pod."""

    def __init__(self, refused: str) -> None:
        super().__init__(refused)
        self.refused = refused


@dataclass(slots=True)
class Routed(Generic[R]):
    """One decision, entered in the ledger: the chosen pod and every candidate's row."""

    route_id: str
    pod: str
    rank: int
    reason: Reason
    rows: list[R]
    warnings: list[str]  # the view's, then the decision's own
    future_prefill: float  # the cost's F for this request
    excluded: dict[str, str]  # candidates ejected after failures, with why
    pd: bool = False  # P/D decided: ``pod`` is the decode pod
    prefill_pod: str | None = None
    prefill_rank: int | None = None
    prefill_reason: str | None = None


@dataclass(slots=True)
class _Request:
    """One decision's working state: the request, the view and what it found."""

    ask: RouteAsk
    view: IndexView
    block_size: int
    speculative: dict[str, int]  # member -> speculative blocks past its match
    continues: bool  # the request claimed a session's home
    session_member: str | None = None  # where its session last ran, when it may decide


class Routing:
    """Decides ``/route`` requests and owns the state they share.

    ``loads`` (scraped) and ``event_lag`` (written by ingest) are read, never written;
    ``roles`` gives each pod's P/D role; ``sessions(model, session_id)``, the member
    where a client session's latest turn was computed (learned by ingest:
    :class:`~kvindex.indexer.sessions.SessionPods`), or None. The ledger, the speculative
    entries and the outlier detector are thread-safe; the counts take their own lock."""

    def __init__(
        self,
        router: Router,
        loads: LoadView,
        ledger: InFlightLedger,
        speculative: SpeculativeIndex,
        outliers: OutlierDetector,
        event_lag: EventLag,
        roles: Callable[[], Mapping[str, Role]],
        *,
        route_ttl: float,
        pd_threshold: int,
        sessions: Callable[[str, str], str | None] | None = None,
    ) -> None:
        self.router = router
        self.loads = loads
        self.ledger = ledger
        self.speculative = speculative
        self.outliers = outliers
        self._event_lag = event_lag
        self._roles = roles
        self._route_ttl = route_ttl
        self._pd_threshold = pd_threshold
        self._sessions = sessions
        self._counts_lock = threading.Lock()
        self._decisions: dict[str, int] = {}  # reason -> decisions, first seen first
        self._prefill_outcomes: dict[str, int] = {}  # "local" or "remote" -> P/D routes
        self._saturated = 0

    # -- the counts /metrics exports ----------------------------------------------------

    def decision_counts(self) -> dict[str, int]:
        """Decisions by reason, in the order the reasons were first seen."""
        with self._counts_lock:
            return dict(self._decisions)

    def prefill_counts(self) -> dict[str, int]:
        """P/D routes by outcome (``remote``: a prefill pod chosen; ``local``)."""
        with self._counts_lock:
            return dict(self._prefill_outcomes)

    def saturated_count(self) -> int:
        """Decisions taken with no candidate KV room (:meth:`Router.decide`'s saturated)."""
        return self._saturated

    # -- a route's life -----------------------------------------------------------------

    def decide(
        self, ask: RouteAsk, pods: list[str], view: IndexView, block_size: int, row: RowMaker[R]
    ) -> Routed[R]:
        """The decision among ``pods`` (not empty) for ``ask``, entered in the ledger and
        the speculative entries; ``row`` builds each candidate's answer row. Raises
        NoRoom when no candidate is admissible, Unavailable when none has the role asked.

        Pods without data-parallel ranks and without P/D take the one-pass path
        (:mod:`kvindex.scoring.route.one_pass`); the others the general one. Both decide
        alike."""
        speculative = annotate(view.result, self.speculative) if view.result else {}
        discredit(view.matches, speculative, view.doubts)
        ledger = self.ledger
        # the session this request continues is back
        continues = ledger.arrive(view.keys, ask.session_id)
        loads, in_flight = self.loads.snapshot(pods), ledger.all()
        roles = self._roles()
        split = disaggregated(roles, pods)
        # Later turns are priced where a session starts: a later turn follows its history
        # (its u decides), and under P/D later turns prefill on the prefill pods.
        future = 0.0 if continues or split else ledger.future_prefill()
        excluded = self.outliers.excluded(pods)
        request = _Request(ask, view, block_size, speculative, continues)
        request.session_member = self._session_member(ask, view, pods, loads, excluded)
        if ask.role is None and not split:
            preferred = request.session_member
            done = one_pass(
                self.router, pods, view.matches, speculative, loads, in_flight,
                view.prompt_tokens, block_size, view.fallback, row,
                self._event_lag.batches(), future, excluded,
                None if preferred is None else member_pod(preferred),
            )  # fmt: skip
            if done is not None:
                for pod in done.dropped:  # each a PodLoad with a start time (the loop's rule)
                    _ignore_restarted(request, pod, loads[pod].started)  # type: ignore[union-attr]
                return self._enter_pass(request, pods, done, future, excluded)
        self._drop_restarted(request, loads)
        return self._decide_targets(request, pods, loads, in_flight, roles, future, excluded, row)

    def first_token(self, route_id: str) -> str | None:
        """The route's first token is out: its prefill no longer counts as queued on its
        pod (under P/D the prefill pod's share ends); it counts as a request until
        :meth:`done`. The pod, or None when the route is not open."""
        member = self.ledger.first_token(route_id)
        self.ledger.done(route_id + _PREFILL)
        return None if member is None else member_pod(member)

    def done(self, route_id: str, outcome: Outcome | None = None) -> str | None:
        """The route finished (its P/D prefill share too); ``outcome``, how its pod
        answered, goes to the pod's failure record. The pod, or None when the route is
        not open."""
        member = self.ledger.done(route_id)
        self.ledger.done(route_id + _PREFILL)
        if member is None:
            return None
        pod = member_pod(member)
        if outcome is not None:
            self.outliers.report(pod, outcome)
        return pod

    # -- the two paths ------------------------------------------------------------------

    def _enter_pass(
        self,
        request: _Request,
        pods: list[str],
        done: Pass[R],
        future: float,
        excluded: dict[str, str],
    ) -> Routed[R]:
        """The one-pass decision entered: its rows are the candidates."""
        self._count(done.reason)
        if done.saturated:
            self._saturated_warning(request.view)
        if done.chosen is None:
            raise NoRoom("; ".join(done.refused))
        pod = pods[done.chosen]
        view = request.view
        route_id = self._enter(request, pod, done.confirmed, done.usable)
        return Routed(route_id, pod, 0, done.reason, done.rows, view.warnings, future, excluded)

    def _decide_targets(
        self,
        request: _Request,
        pods: list[str],
        loads: dict[str, PodLoad | Unknown],
        in_flight: dict[str, InFlight],
        roles: Mapping[str, Role],
        future: float,
        excluded: dict[str, str],
        row: RowMaker[R],
    ) -> Routed[R]:
        """The general path: one routing target per engine (data-parallel ranks), a role
        filter, P/D."""
        view, role = request.view, request.ask.role
        targets = build_targets(pods, view.matches, request.speculative, loads, in_flight)
        if role is not None:
            targets = of_role(targets, roles, Role(role))
        if not targets:
            raise Unavailable(f"no candidate pod has role {role} or both", code="no_pods")
        tokens, block_size = view.prompt_tokens, request.block_size
        ejected = {t.member for t in targets if t.pod in excluded}
        if role is None and disaggregated(roles, pods):
            pd = decide_pd(
                self.router, targets, roles, tokens, block_size, view.fallback,
                self._pd_threshold, ejected,
            )  # fmt: skip
            decision, prefill = pd.decode, pd.prefill
            if decision.pod is not None:
                self._count_prefill("local" if prefill is None else "remote")
        else:
            pd, prefill = None, None
            decision = self.router.decide(
                [t.inputs for t in targets],
                {t.member: t.kv_usage_max for t in targets},
                tokens,
                block_size,
                view.fallback,
                future,
                ejected,
                _session_target(targets, request.session_member),
            )
        self._count(decision.reason)
        if decision.saturated or (prefill is not None and prefill.saturated):
            self._saturated_warning(view)
        if decision.pod is None:
            raise NoRoom("; ".join(f"{c.inputs.pod}: {c.refused}" for c in decision.candidates))
        by_member = {t.member: t for t in targets}
        chosen = by_member[decision.pod]
        terms = next(c.terms for c in decision.candidates if c.inputs.pod == decision.pod)
        remote = prefill is not None and prefill.pod is not None
        route_id = self._enter(
            request, chosen.member, chosen.confirmed_blocks,
            None if remote else terms.usable_blocks,
        )  # fmt: skip
        routed = Routed(
            route_id,
            chosen.pod,
            chosen.rank,
            decision.reason,
            target_rows(decision, prefill, by_member, roles, row),
            view.warnings,
            future,
            excluded,
        )
        if pd is not None:
            routed.pd = True
            routed.prefill_reason = pd.local_why
            if prefill is not None and prefill.pod is not None:
                source = by_member[prefill.pod]
                routed.prefill_pod, routed.prefill_rank = source.pod, source.rank
                routed.prefill_reason = prefill.reason.value
                usable = next(c.terms for c in prefill.candidates if c.inputs.pod == prefill.pod)
                self._enter(
                    request, source.member, source.confirmed_blocks, usable.usable_blocks,
                    prefill_leg=route_id + _PREFILL,
                )  # fmt: skip
        return routed

    # -- entering a decision ------------------------------------------------------------

    def _enter(
        self,
        request: _Request,
        member: str,
        confirmed_blocks: int,
        usable_blocks: int | None,
        *,
        prefill_leg: str | None = None,
    ) -> str:
        """Count a routed request against ``member`` in the ledger (under the request's id
        or a new one, which is returned; under ``prefill_leg`` for P/D's prefill share),
        with the prompt tokens past its ``usable_blocks`` as the prefill it queues there
        (none when None: under P/D another pod prefills), and enter the prompt's blocks past
        its confirmed prefix as speculative entries."""
        ask, view, block_size = request.ask, request.view, request.block_size
        tokens = view.prompt_tokens
        route_id = prefill_leg or ask.request_id or uuid.uuid4().hex
        # The blocks the request will hold at its end: its prompt and expected output.
        held = -(-(tokens + (ask.max_tokens or 0)) // block_size)
        prefill = 0 if usable_blocks is None else max(0, tokens - usable_blocks * block_size)
        # Once done, the request's session is homed on the pod that holds its context: the
        # decode pod, not P/D's prefill leg.
        tail = view.keys[-1] if view.keys and prefill_leg is None else None
        # A continuation turn's prefill, once per request: where it is computed.
        turn = request.continues and usable_blocks is not None
        session = ask.session_id if prefill_leg is None else None
        self.ledger.begin(
            member, route_id, held, self._route_ttl, prefill, tail, continues=turn, session=session
        )
        # Speculative: the blocks past what the chosen engine's index entries already hold.
        if len(view.keys) > confirmed_blocks:
            self.speculative.add(ask.model, member, view.keys, confirmed_blocks)
        return route_id

    def _session_member(
        self,
        ask: RouteAsk,
        view: IndexView,
        pods: list[str],
        loads: Mapping[str, PodLoad | Unknown],
        excluded: Mapping[str, str],
    ) -> str | None:
        """The member where ``ask``'s session last ran, when it may take a load-only
        decision's place: the prompt could not be scored (a fallback in
        :data:`~kvindex.scoring.route.decision.SESSION_FALLBACKS`), and its pod is a
        candidate whose load is known, that is not ejected, whose entries would be
        credited their prefix (:func:`~kvindex.scoring.route.doubt.credits_prefix`: not
        ``gapped`` or ``hash_mismatch``, whose lost batches or wrong keys may hide that
        the session's blocks are gone; a ``lagging`` or ``replaying`` stream still says
        truly where the session ran), and that has not restarted since its last batch
        (its cache would be empty). Admission still applies (:meth:`Router.choose`)."""
        session = ask.session_id
        if session is None or self._sessions is None or view.fallback not in SESSION_FALLBACKS:
            return None
        member = self._sessions(ask.model, session)
        if member is None:
            return None
        pod = member_pod(member)
        if pod in excluded or not credits_prefix(view.doubts.get(pod)) or pod not in pods:
            return None
        load = loads.get(pod)
        if type(load) is not PodLoad:
            return None
        heard = self._event_lag.last_batch_ts(member)
        if load.started is not None and (heard is None or heard < load.started):
            return None
        return member

    def _drop_restarted(self, request: _Request, loads: Mapping[str, PodLoad | Unknown]) -> None:
        """A pod whose server started (``process_start_time_seconds``, its clock) after the
        engine timestamp of the last KV-event batch the index applied live from it
        restarted and has not published since: its engine's cache is empty, while the
        index still holds the old engine's blocks until the new engine's first batch
        resets the stream. Its matches and speculative entries are dropped from this
        decision, with a warning, so requests whose history it held are not sent back to
        it for a cache it lost. A pod whose page has no start time (several API server
        processes), or with no live batch recorded, is taken as it is."""
        matches, speculative = request.view.matches, request.speculative
        if not matches and not speculative:
            return
        last_ts = self._event_lag.last_batch_ts
        for member in [*matches, *(m for m in speculative if m not in matches)]:
            load = loads.get(member_pod(member))
            if type(load) is not PodLoad or load.started is None:
                continue
            heard = last_ts(member)
            if heard is None or heard >= load.started:
                continue
            _ignore_restarted(request, member, load.started)

    def _saturated_warning(self, view: IndexView) -> None:
        """No candidate had KV room, so KV usage refused none of them
        (:meth:`~kvindex.scoring.route.decision.Admission.kv_limit`): say so, and count it."""
        with self._counts_lock:
            self._saturated += 1
        limit = self.router.admission.max_kv_usage
        view.warnings.append(
            f"every candidate's KV cache is above --max-kv-usage {limit} (saturated): "
            "all admitted, chosen by cost"
        )

    def _count(self, reason: Reason) -> None:
        with self._counts_lock:
            self._decisions[reason] = self._decisions.get(reason, 0) + 1

    def _count_prefill(self, outcome: str) -> None:
        with self._counts_lock:
            self._prefill_outcomes[outcome] = self._prefill_outcomes.get(outcome, 0) + 1


def _ignore_restarted(request: _Request, member: str, started: float) -> None:
    """``member``'s server started at ``started`` and the index has not heard from it
    since: its index entries are left out, with a warning."""
    request.view.matches.pop(member, None)
    request.speculative.pop(member, None)
    request.view.warnings.append(
        f"pod {member}: restarted (process start {started:.0f}) and no KV events "
        "since; its index entries are ignored"
    )


def _session_target(targets: Sequence[Target], member: str | None) -> str | None:
    """The routing target (a member) standing for the session's ``member``: itself, or
    its pod's target when the pod's ranks are not separate targets; None when neither
    is a candidate."""
    if member is None:
        return None
    members = {t.member for t in targets}
    if member in members:
        return member
    pod = member_pod(member)
    return pod if pod in members else None


def target_rows(
    decision: Decision,
    prefill: Decision | None,
    targets: Mapping[str, Target],
    roles: Mapping[str, Role],
    row: RowMaker[R],
) -> list[R]:
    """Every costed target once, as ``row`` builds it: the decode (or only) decision's,
    then the prefill decision's targets that only prefill."""
    out: list[R] = []
    seen: set[str] = set()
    both = Role.BOTH.value
    role_of = {pod: role.value for pod, role in roles.items()}
    made: Sequence[Decision | None] = (decision, prefill)
    for one in made:
        for c in one.candidates if one is not None else ():
            member = c.inputs.pod
            if prefill is not None:  # only P/D's two decisions can share a member
                if member in seen:
                    continue
                seen.add(member)
            target = targets[member]
            load = target.load
            known = type(load) is PodLoad
            terms, inputs = c.terms, c.inputs
            out.append(
                row(
                    target.pod,
                    target.rank,
                    role_of.get(target.pod, both),
                    target.confirmed_blocks,
                    target.speculative_blocks,
                    terms.usable_blocks,
                    terms.uncached_blocks,
                    "known" if known else load.reason,  # type: ignore[union-attr]
                    load.running if known else None,  # type: ignore[union-attr]
                    inputs.waiting,
                    inputs.kv_usage,
                    inputs.in_flight,
                    inputs.sessions,
                    inputs.prefill_tokens,
                    terms.prefix,
                    terms.queue,
                    terms.decode,
                    terms.kv,
                    terms.total,
                    c.refused is None,
                    c.refused,
                )
            )
    return out
