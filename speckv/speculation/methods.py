"""What `--speculative-method` names, and what the engine asks of a drafter model.

Owns the registry of speculative methods (`METHODS`: name → `SpeculativeMethod`) and the
`Drafter` protocol. A method either runs a drafter model loaded from `--speculative-model`
(EAGLE, EAGLE3, MTP: the drafter builds its own proposer) or builds its proposer from the
speculative options alone (n-gram). A new method adds its proposer in its own file and one
line to `METHODS`; the engine's config, flags and proposer choice read the registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

from torch import nn

from speckv.cache.drafter_policy import DrafterPolicy
from speckv.speculation.adaptive import Clock
from speckv.speculation.proposer import Proposer


class SpeculativeOptions(Protocol):
    """The speculative options a model-free method reads (the engine's SpeculativeConfig)."""

    @property
    def num_speculative_tokens(self) -> int: ...
    @property
    def prompt_lookup_min(self) -> int: ...
    @property
    def prompt_lookup_max(self) -> int: ...


class Drafter(Protocol):
    """A drafter model the engine runs: a chain of draft modules with its own draft KV
    (EAGLE, EAGLE3, MTP, a GDN hybrid's MTP head) or the Gemma 4 assistant that reads the
    target's KV."""

    @property
    def speculative_method(self) -> str:
        """The `--speculative-method` word that runs it."""
        ...

    @property
    def policy(self) -> DrafterPolicy:
        """Its entry in the policy table: decides lookahead hashes or the legacy drop."""
        ...

    @property
    def num_kv_layers(self) -> int:
        """Layers of its own draft KV in the target's blocks (0: it keeps none)."""
        ...

    def make_proposer(self, num_spec_tokens: int, num_blocks: int, block_size: int,
                      clock: Clock) -> Proposer:
        """The engine's proposer over this drafter (`num_blocks` blocks of `block_size`
        tokens for a draft KV it keeps), timed with `clock`."""
        ...

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True
                         ) -> Iterator[tuple[str, nn.Parameter]]: ...


# builds a model-free method's proposer from the speculative options
ProposerFactory = Callable[[SpeculativeOptions, Clock], Proposer]


@dataclass(frozen=True)
class SpeculativeMethod:
    """One `--speculative-method`. `make_proposer` None: it runs a drafter model
    (`--speculative-model`), which builds the proposer itself."""

    name: str
    make_proposer: ProposerFactory | None = None

    @property
    def needs_drafter(self) -> bool:
        return self.make_proposer is None


def _ngram(options: SpeculativeOptions, clock: Clock) -> Proposer:
    from speckv.speculation.ngram import NgramProposer

    return NgramProposer(options.num_speculative_tokens, options.prompt_lookup_min,
                         options.prompt_lookup_max, clock)


METHODS: Mapping[str, SpeculativeMethod] = MappingProxyType({method.name: method for method in (
    SpeculativeMethod("ngram", _ngram),
    SpeculativeMethod("eagle"),
    SpeculativeMethod("eagle3"),
    SpeculativeMethod("mtp"),
)})
