"""Which ringsync wrapper averages, and which steps, a parameter: a parameter that two
of them handle (a ShardedModule's slice given to DistributedOptimizer, one model given
to two live ShardedOptimizers) would have its gradient averaged twice or be stepped
twice — wrong numbers, and nothing would say so. Each wrapper marks the parameters it
takes with a weak reference to itself, and refuses those a live other one holds."""
import weakref

from ringsync.errors import UsageError

AVERAGED = "_ringsync_averaged_by"  # ShardedModule, ShardedOptimizer stages 1 and 2
STEPPED = "_ringsync_stepped_by"  # ShardedOptimizer, every stage


class _Mark:
    """A weak reference to the wrapper holding a parameter, stored on the parameter. It
    pickles as a dead mark (torch.save(model) pickles the parameters' attributes, and a
    weak reference cannot be pickled; a saved model's parameters belong to no wrapper)."""
    __slots__ = ("ref",)

    def __init__(self, wrapper=None):
        self.ref = weakref.ref(wrapper) if wrapper is not None else None

    def __reduce__(self):
        return _Mark, ()

    def wrapper(self):
        return self.ref() if self.ref is not None else None


def holder(p, kind):
    """The live wrapper that marked p as `kind`, or None."""
    mark = getattr(p, kind, None)
    return mark.wrapper() if mark is not None else None


def refuse_held(params, names, kind, me, what):
    """UsageError naming the first parameter a live wrapper other than `me` holds as kind."""
    for p, name in zip(params, names):
        other = holder(p, kind)
        if other is not None and other is not me:
            doing = "averages its gradient" if kind == AVERAGED else "steps it"
            raise UsageError(
                f"{what}: {name} is already taken by a {type(other).__name__}, which "
                f"{doing}; a second wrapper would do it twice. Give each parameter to one "
                "of them (ShardedModule's parameters: a ShardedOptimizer(stage=3) or a plain "
                "torch optimizer)")


def claim(params, kind, me):
    for p in params:
        setattr(p, kind, _Mark(me))
