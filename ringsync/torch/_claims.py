"""Which ringsync wrapper averages, and which steps, a parameter: a parameter that two
of them handle (a ShardedModule's slice given to DistributedOptimizer, one model given
to two live ShardedOptimizers) would have its gradient averaged twice or be stepped
twice — wrong numbers, and nothing would say so. Each wrapper marks the parameters it
takes with a weak reference to itself, and refuses those a live other one holds."""
import weakref

from ringsync.errors import UsageError

AVERAGED = "_ringsync_averaged_by"  # ShardedModule, ShardedOptimizer stages 1 and 2
STEPPED = "_ringsync_stepped_by"  # ShardedOptimizer, every stage


def holder(p, kind):
    """The live wrapper that marked p as `kind`, or None."""
    ref = getattr(p, kind, None)
    return ref() if ref is not None else None


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
        setattr(p, kind, weakref.ref(me))
