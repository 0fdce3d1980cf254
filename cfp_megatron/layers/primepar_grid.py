"""PrimePar's 2^k x 2^k square of ranks: its Dimension Slice Indices (DSIs), its ring transfers, and its groups.

PrimePar's primitive P_{2^k x 2^k} (../papers/NOTES.md 1.4) runs a linear layer O[M, K] = I[M, N] @ W[N, K] on a
2^k x 2^k square of ranks over 2^k time steps, Cannon style. Rank (r, c) works at step t on the blocks given by the
DSIs below (n = 2^k, T = n - 1 the last step, delta = 1 at t = T else 0, every index mod n)::

    phase     I_M        I_N                 I_K           summed   stays on the rank
    Forward   r          r + c + t           c             N        O  (M r, K c)
    Backward  r          r + c - 1           c + t         K        dI (M r, N r+c-1)
    Gradient  r + t      r + c - 1 + delta   c - 1 + delta M        dW (N r+c-1, K c-1), then (r+c, c) at T

so each rank accumulates its output block locally over the n steps (no all-reduce), no two ranks ever hold the same
block of any tensor (no replication), and each phase ends in the layout the next one starts from (I at the end of
Forward is the block Gradient starts with; dW at the end of Gradient has the layout of W at the start of Forward, so
it is the parameter's gradient as it is).

Between steps the operand blocks move by ring point-to-point transfers (the paper's Table 1, :func:`ring_transfers`),
posted before a step's GEMM and waited after it, so they overlap the compute. Every formula here is pure (no
``torch.distributed`` call): the tests check the DSIs' properties and derive each ring sender from the DSIs for
k = 1, 2, 3 in one process. Table 1 as transcribed in NOTES.md agrees with the DSIs at every step (checked there).

The ranks of a square come from :func:`new_grids`, which cuts the world into consecutive blocks of 4^k ranks (ranks
in different squares are data-parallel replicas of each other; :func:`new_replica_groups` builds those groups). A
position (r, c) maps to a rank inside its block by the paper's Algorithm 1 (:attr:`RankOrder.ALGORITHM_1`): the 2k
device-ID bits that P_{2^k x 2^k} consumes, most significant first, alternate between r and c, so r takes the bits
at even offsets and c the bits at odd offsets. For k = 1 that is row-major (rank 2r + c); for k = 2 the four 2x2
sub-squares are the four runs of 4 consecutive ranks (Z order). The device-ID bit d_1 is taken as the most
significant bit of the rank, which matches the notes' Fig. 9 example (an N partition on d_1 over 8 GPUs gives the
all-reduce groups (0,4), (1,5), ...). :attr:`RankOrder.ROW_MAJOR` is there for clusters where rows should be runs of
consecutive ranks instead.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from cfp_megatron.layers.errors import PrimeParError

__all__ = [
    "Dim",
    "Operand",
    "Phase",
    "PhaseStep",
    "PrimeParGrid",
    "RankOrder",
    "RingTransfer",
    "SliceIndex",
    "TransferKind",
    "EXTRA_TRANSFERS",
    "GRAD_INPUT_REALIGN",
    "GRAD_OUTPUT_SHIFT",
    "WEIGHT_FETCH",
    "check_k",
    "dsi",
    "extra_transfer",
    "grid_position",
    "new_grids",
    "new_replica_groups",
    "phase_operands",
    "ring_transfers",
    "square_ranks",
    "summed_dim",
]


class Phase(enum.Enum):
    """The three phases of a linear layer's training step."""

    FORWARD = "forward"
    """O = I @ W, summed over N."""
    BACKWARD = "backward"
    """dI = dO @ W^T, summed over K."""
    GRADIENT = "gradient"
    """dW = I^T @ dO, summed over M (the flattened tokens)."""


class Dim(enum.Enum):
    """The three dimensions of a linear layer (M is the flattened B*M tokens)."""

    M = "M"
    N = "N"
    K = "K"


class Operand(enum.Enum):
    """A tensor of the linear layer; its value is its short name in the notes."""

    INPUT = "I"
    WEIGHT = "W"
    OUTPUT = "O"
    GRAD_OUTPUT = "dO"
    GRAD_INPUT = "dI"
    GRAD_WEIGHT = "dW"

    @property
    def dims(self) -> tuple[Dim, Dim]:
        """The tensor's two dimensions, in storage order (I and dI: (M, N); W and dW: (N, K); O and dO: (M, K))."""
        return _OPERAND_DIMS[self]

    @property
    def tag(self) -> int:
        """A point-to-point tag, distinct per operand, so two transfers between the same pair never mix."""
        return list(Operand).index(self) + 1


_OPERAND_DIMS = {
    Operand.INPUT: (Dim.M, Dim.N),
    Operand.GRAD_INPUT: (Dim.M, Dim.N),
    Operand.WEIGHT: (Dim.N, Dim.K),
    Operand.GRAD_WEIGHT: (Dim.N, Dim.K),
    Operand.OUTPUT: (Dim.M, Dim.K),
    Operand.GRAD_OUTPUT: (Dim.M, Dim.K),
}

_PHASE_OPERANDS = {
    Phase.FORWARD: (Operand.INPUT, Operand.WEIGHT, Operand.OUTPUT),
    Phase.BACKWARD: (Operand.GRAD_OUTPUT, Operand.WEIGHT, Operand.GRAD_INPUT),
    Phase.GRADIENT: (Operand.INPUT, Operand.GRAD_OUTPUT, Operand.GRAD_WEIGHT),
}

_SUMMED = {Phase.FORWARD: Dim.N, Phase.BACKWARD: Dim.K, Phase.GRADIENT: Dim.M}


def phase_operands(phase: Phase) -> tuple[Operand, Operand, Operand]:
    """The two operands a phase multiplies (they move between steps) and the result it accumulates, in that order."""
    return _PHASE_OPERANDS[phase]


def summed_dim(phase: Phase) -> Dim:
    """The dimension a phase sums over (N in Forward, K in Backward, M in Gradient)."""
    return _SUMMED[phase]


def check_k(k: int) -> int:
    """Return the side 2^k of a square after checking k (an int >= 1); raise :class:`PrimeParError` otherwise."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise PrimeParError(f"k must be an integer >= 1 (the square has 2^k x 2^k ranks), got {k!r}.",
                            fix="use k=1 for 4 ranks, k=2 for 16 ranks.", setting="k")
    return 1 << k


def _check_step(step: int, n: int) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < n:
        raise PrimeParError(f"step must be an integer in [0, {n}) for a {n}x{n} square, got {step!r}.",
                            fix=f"pass a step between 0 and {n - 1}.", setting="step")


def _check_position(row: int, col: int, n: int) -> None:
    for name, value in (("row", row), ("col", col)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n:
            raise PrimeParError(f"{name} must be an integer in [0, {n}) for a {n}x{n} square, got {value!r}.",
                                fix=f"pass a {name} between 0 and {n - 1}.", setting=name)


@dataclass(frozen=True, kw_only=True)
class SliceIndex:
    """The DSI of one rank at one step: which block of each dimension it works on (each in [0, 2^k))."""

    m: int
    """Block of M (the flattened tokens)."""
    n: int
    """Block of N (in_features)."""
    k: int
    """Block of K (out_features)."""

    def of(self, dim: Dim) -> int:
        """The block index of one dimension."""
        return {Dim.M: self.m, Dim.N: self.n, Dim.K: self.k}[dim]

    def block(self, operand: Operand) -> tuple[int, int]:
        """The (row block, column block) of an operand this DSI names, in the operand's storage order."""
        first, second = operand.dims
        return self.of(first), self.of(second)


def dsi(phase: Phase, *, k: int, row: int, col: int, step: int) -> SliceIndex:
    """The DSI of rank (row, col) of a 2^k x 2^k square at step ``step`` of ``phase`` (NOTES.md 1.4's table)."""
    n = check_k(k)
    _check_position(row, col, n)
    _check_step(step, n)
    r, c, t = row, col, step
    if phase is Phase.FORWARD:
        return SliceIndex(m=r % n, n=(r + c + t) % n, k=c % n)
    if phase is Phase.BACKWARD:
        return SliceIndex(m=r % n, n=(r + c - 1) % n, k=(c + t) % n)
    delta = 1 if t == n - 1 else 0
    return SliceIndex(m=(r + t) % n, n=(r + c - 1 + delta) % n, k=(c - 1 + delta) % n)


@dataclass(frozen=True, kw_only=True)
class PhaseStep:
    """One step of one phase: the moment a layout belongs to."""

    phase: Phase
    """The phase."""
    step: int
    """The step within it, in [0, 2^k)."""


class TransferKind(enum.Enum):
    """What a ring transfer delivers."""

    NEXT_STEP = "next_step"
    """The sender's block at step t is the block the receiver computes with at step t + 1 (the double buffer)."""
    REALIGN = "realign"
    """The sender's block is the one the receiver needs at the start of another phase (or as the layer's result)."""
    PARTIAL_SUM = "partial_sum"
    """The sender's partial sum (accumulated so far) is added to the receiver's product of this step."""


@dataclass(frozen=True, kw_only=True)
class RingTransfer:
    """One ring transfer: every rank (r, c) receives ``operand`` from rank (r, c) + ``offset`` (mod 2^k) and sends its
    own to (r, c) - ``offset``, so the whole square shifts the operand along a row, column or diagonal ring.
    """

    operand: Operand
    """The tensor that moves."""
    offset: tuple[int, int]
    """(row, column) offset of the sender from the receiver, e.g. (0, 1): from the right neighbour."""
    kind: TransferKind
    """What the received block is for."""
    source: PhaseStep
    """The moment whose layout the sender's block has (the DSIs of the sender at that step name it)."""
    target: PhaseStep
    """The moment whose layout the received block has (the DSIs of the receiver at that step name it)."""
    note: str = ""
    """Where it comes from (Table 1 or this implementation), for people."""

    def sender(self, *, k: int, row: int, col: int) -> tuple[int, int]:
        """The rank that sends to (row, col), with wrap-around."""
        n = check_k(k)
        _check_position(row, col, n)
        return (row + self.offset[0]) % n, (col + self.offset[1]) % n

    def receiver(self, *, k: int, row: int, col: int) -> tuple[int, int]:
        """The rank that (row, col) sends to, with wrap-around."""
        n = check_k(k)
        _check_position(row, col, n)
        return (row - self.offset[0]) % n, (col - self.offset[1]) % n


def _next(operand: Operand, offset: tuple[int, int], phase: Phase, step: int) -> RingTransfer:
    return RingTransfer(operand=operand, offset=offset, kind=TransferKind.NEXT_STEP,
                        source=PhaseStep(phase=phase, step=step), target=PhaseStep(phase=phase, step=step + 1),
                        note="Table 1")


@functools.cache  # pure; every layer call asks for each step's transfers
def ring_transfers(phase: Phase, *, k: int, step: int) -> tuple[RingTransfer, ...]:
    """The ring transfers that overlap compute step ``step`` of ``phase`` (the paper's Table 1; offsets are the
    sender's position relative to the receiver (r, c)).

    Forward, t < T: I <- (r, c+1), W <- (r+1, c); t = T: nothing. Backward, t < T: dO <- (r, c+1), W <- (r-1, c+1);
    t = T: W <- (r, c+1), which realigns W for the next Forward. Gradient, t < T-1: I <- (r+1, c-1), dO <- (r+1, c);
    t = T-1: I <- (r+1, c), dO <- (r+1, c+1); t = T: the partial dW <- (r, c+1), added to the last step's product.
    Each of these is checked against the DSIs in the tests: the sender's block is the one the receiver's DSI needs.
    """
    n = check_k(k)
    _check_step(step, n)
    last = n - 1
    if phase is Phase.FORWARD:
        if step < last:
            return (_next(Operand.INPUT, (0, 1), phase, step), _next(Operand.WEIGHT, (1, 0), phase, step))
        return ()
    if phase is Phase.BACKWARD:
        if step < last:
            return (_next(Operand.GRAD_OUTPUT, (0, 1), phase, step), _next(Operand.WEIGHT, (-1, 1), phase, step))
        return (RingTransfer(operand=Operand.WEIGHT, offset=(0, 1), kind=TransferKind.REALIGN,
                             source=PhaseStep(phase=phase, step=last), target=PhaseStep(phase=Phase.FORWARD, step=0),
                             note="Table 1: realigns W for the next Forward"),)
    if step < last - 1:
        return (_next(Operand.INPUT, (1, -1), phase, step), _next(Operand.GRAD_OUTPUT, (1, 0), phase, step))
    if step == last - 1:
        return (_next(Operand.INPUT, (1, 0), phase, step), _next(Operand.GRAD_OUTPUT, (1, 1), phase, step))
    return (RingTransfer(operand=Operand.GRAD_WEIGHT, offset=(0, 1), kind=TransferKind.PARTIAL_SUM,
                         source=PhaseStep(phase=phase, step=last - 1), target=PhaseStep(phase=phase, step=last),
                         note="Table 1: dW accumulated so far, added to the last step's product"),)


# Transfers this implementation adds to Table 1 (each one ring hop; the tests check them against the DSIs like the
# table's). Their source/target steps that depend on k are given for k through ``extra_transfers``.

GRAD_INPUT_REALIGN = "grad_input_realign"
"""dI <- (r, c+1): Backward leaves dI in the layout (M r, N r+c-1), one column hop from the layout the input had at
the start of Forward, (M r, N r+c). In a whole PrimePar model that shift is part of the resharding to the previous
operator (Eq. 9); as a standalone autograd function the layer must return dI in its input's layout, so it sends dI
one hop left, overlapped with the first Gradient step."""

WEIGHT_FETCH = "weight_fetch"
"""W <- (r-1, c): Backward starts from the W layout Forward ended with, (N r+c-1, K c). With
``keep_rotated_weight=False`` the layer does not keep that block between the phases and fetches it from the rank
above, whose parameter it is, before the first Backward step (not overlapped)."""

GRAD_OUTPUT_SHIFT = "grad_output_shift"
"""dO <- (r, c-1): when the input needs no gradient, Backward is skipped, and dO goes straight from its layout at the
start of Backward, (M r, K c), to the one Gradient starts from, (M r, K c-1)."""

EXTRA_TRANSFERS = (GRAD_INPUT_REALIGN, WEIGHT_FETCH, GRAD_OUTPUT_SHIFT)
"""The names of the transfers this implementation adds, for :func:`extra_transfer`."""


@functools.cache
def extra_transfer(name: str, *, k: int) -> RingTransfer:
    """One of the transfers this implementation adds to Table 1 (see :data:`EXTRA_TRANSFERS`), for a 2^k square."""
    last = check_k(k) - 1
    if name == GRAD_INPUT_REALIGN:
        return RingTransfer(operand=Operand.GRAD_INPUT, offset=(0, 1), kind=TransferKind.REALIGN,
                            source=PhaseStep(phase=Phase.BACKWARD, step=last),
                            target=PhaseStep(phase=Phase.FORWARD, step=0),
                            note="added: dI back to the layout of the layer's input")
    if name == WEIGHT_FETCH:
        return RingTransfer(operand=Operand.WEIGHT, offset=(-1, 0), kind=TransferKind.REALIGN,
                            source=PhaseStep(phase=Phase.FORWARD, step=0),
                            target=PhaseStep(phase=Phase.BACKWARD, step=0),
                            note="added: W for Backward when Forward's last W block was not kept")
    if name == GRAD_OUTPUT_SHIFT:
        return RingTransfer(operand=Operand.GRAD_OUTPUT, offset=(0, -1), kind=TransferKind.REALIGN,
                            source=PhaseStep(phase=Phase.BACKWARD, step=0),
                            target=PhaseStep(phase=Phase.GRADIENT, step=0),
                            note="added: dO for Gradient when Backward is skipped")
    raise PrimeParError(f"unknown extra transfer {name!r}.", fix=f"use one of {EXTRA_TRANSFERS}.", setting="name")



class RankOrder(enum.Enum):
    """How grid positions (r, c) map to the ranks of a block of 4^k consecutive ranks."""

    ALGORITHM_1 = "algorithm_1"
    """The paper's Algorithm 1: the square's 2k rank bits, most significant first, alternate r, c, r, c, ... (r gets
    the even-offset bits, c the odd ones). k = 1: rank 2r + c; k = 2: each 2x2 sub-square is 4 consecutive ranks."""
    ROW_MAJOR = "row_major"
    """Rank r * 2^k + c: each row of the square is a run of consecutive ranks."""


def grid_position(index: int, *, k: int, order: RankOrder = RankOrder.ALGORITHM_1) -> tuple[int, int]:
    """The (row, col) of the rank at ``index`` (0 <= index < 4^k) within its square."""
    n = check_k(k)
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n * n:
        raise PrimeParError(f"index must be in [0, {n * n}) for a {n}x{n} square, got {index!r}.",
                            fix="pass the rank's offset within its block of 4^k ranks.", setting="index")
    if order is RankOrder.ROW_MAJOR:
        return divmod(index, n)
    row = col = 0
    for level in range(k):  # bits from the most significant: (r bit, c bit) pairs
        pair = (index >> (2 * (k - 1 - level))) & 3
        row = (row << 1) | (pair >> 1)
        col = (col << 1) | (pair & 1)
    return row, col


def square_ranks(k: int, *, square: int = 0, order: RankOrder = RankOrder.ALGORITHM_1) -> tuple[tuple[int, ...], ...]:
    """The global ranks of square number ``square`` (ranks ``square * 4^k`` to ``(square + 1) * 4^k - 1``), as
    ``ranks[row][col]``."""
    n = check_k(k)
    if isinstance(square, bool) or not isinstance(square, int) or square < 0:
        raise PrimeParError(f"square must be an integer >= 0, got {square!r}.", fix="pass the square's number.",
                            setting="square")
    table = [[-1] * n for _ in range(n)]
    for index in range(n * n):
        row, col = grid_position(index, k=k, order=order)
        table[row][col] = square * n * n + index
    return tuple(tuple(row) for row in table)


@dataclass(frozen=True, kw_only=True)
class PrimeParGrid:
    """One rank's view of its 2^k x 2^k square."""

    k: int
    """The square has 2^k x 2^k ranks (k >= 1); each phase runs 2^k steps."""
    row: int
    """This rank's row r in [0, 2^k): its block of M (tokens) in Forward."""
    col: int
    """This rank's column c in [0, 2^k): its block of K (out_features) in Forward."""
    ranks: tuple[tuple[int, ...], ...]
    """Global rank of every position, ``ranks[r][c]`` (2^k rows of 2^k distinct ranks)."""
    group: dist.ProcessGroup | None = None
    """The process group of the square's ranks, used for the point-to-point transfers and the gather helpers;
    ``None`` means the default group (fine when the square is the whole world, and for pure planning use)."""

    def __post_init__(self) -> None:
        n = check_k(self.k)
        _check_position(self.row, self.col, n)
        shape_ok = (isinstance(self.ranks, tuple) and len(self.ranks) == n
                    and all(isinstance(row, tuple) and len(row) == n for row in self.ranks))
        if not shape_ok:
            raise PrimeParError(f"ranks must be a tuple of {n} tuples of {n} global ranks, got {self.ranks!r}.",
                                fix="build the grid with new_grids() or square_ranks().", setting="ranks")
        flat = [rank for row in self.ranks for rank in row]
        if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in flat) or len(set(flat)) != len(flat):
            raise PrimeParError(f"ranks must be {n * n} distinct non-negative integers, got {self.ranks!r}.",
                                fix="give every grid position its own global rank.", setting="ranks")

    @property
    def size(self) -> int:
        """The side of the square, 2^k (also the number of steps per phase)."""
        return 1 << self.k

    @property
    def rank(self) -> int:
        """This rank's global rank."""
        return self.ranks[self.row][self.col]

    def global_rank(self, row: int, col: int) -> int:
        """The global rank at (row, col), with wrap-around (any integers)."""
        return self.ranks[row % self.size][col % self.size]

    def position_of(self, global_rank: int) -> tuple[int, int]:
        """The (row, col) of a global rank of this square."""
        for r, row in enumerate(self.ranks):
            if global_rank in row:
                return r, row.index(global_rank)
        raise PrimeParError(f"rank {global_rank} is not in this square ({self.ranks}).",
                            fix="ask the grid of the square the rank belongs to.", setting="global_rank")

    def dsi(self, phase: Phase, step: int) -> SliceIndex:
        """This rank's DSI at ``step`` of ``phase``."""
        return dsi(phase, k=self.k, row=self.row, col=self.col, step=step)

    def peers(self, transfer: RingTransfer) -> tuple[int, int]:
        """The global ranks (sender to this rank, receiver of this rank's block) of a ring transfer."""
        sender = transfer.sender(k=self.k, row=self.row, col=self.col)
        receiver = transfer.receiver(k=self.k, row=self.row, col=self.col)
        return self.global_rank(*sender), self.global_rank(*receiver)


def _check_world(k: int, world_size: int, rank: int) -> int:
    n = check_k(k)
    square = n * n
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < square \
            or world_size % square:
        raise PrimeParError(f"the world of {world_size!r} ranks does not split into squares of 4^k = {square} "
                            f"ranks (k={k}).", fix=f"run a multiple of {square} ranks, or choose a smaller k.",
                            setting="world_size")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise PrimeParError(f"rank must be in [0, {world_size}), got {rank!r}.",
                            fix="pass torch.distributed.get_rank().", setting="rank")
    return square


def new_grids(k: int, *, world_size: int, rank: int, order: RankOrder = RankOrder.ALGORITHM_1,
              backend: str | None = None, timeout: timedelta | None = None) -> PrimeParGrid:
    """Create the process groups of every square (consecutive blocks of 4^k ranks) and return this rank's grid.

    Every rank must call this, with the same arguments, at the same point: it calls
    ``torch.distributed.new_group`` for every square in order, as Megatron does for its groups. Ranks at the same
    position of different squares are data-parallel replicas (see :func:`new_replica_groups`).
    """
    square = _check_world(k, world_size, rank)
    groups = []
    for index in range(world_size // square):
        ranks = square_ranks(k, square=index, order=order)
        groups.append(dist.new_group(ranks=sorted(r for row in ranks for r in row), timeout=timeout, backend=backend))
    row, col = grid_position(rank % square, k=k, order=order)
    return PrimeParGrid(k=k, row=row, col=col, ranks=square_ranks(k, square=rank // square, order=order),
                        group=groups[rank // square])


def new_replica_groups(k: int, *, world_size: int, rank: int, backend: str | None = None,
                       timeout: timedelta | None = None) -> dist.ProcessGroup:
    """Create the data-parallel groups across squares (the ranks with the same offset in every block of 4^k ranks)
    and return this rank's. Every rank must call this, with the same arguments, at the same point."""
    square = _check_world(k, world_size, rank)
    groups = [dist.new_group(ranks=list(range(offset, world_size, square)), timeout=timeout, backend=backend)
              for offset in range(square)]
    return groups[rank % square]
