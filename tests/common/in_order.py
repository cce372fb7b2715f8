"""Run several rank bodies of one module one after another, in one mpirun job: one process
start and one framework import (seconds each for torch and TensorFlow) serve them all. Each
body starts and shuts ringsync down itself, as it does when it runs alone. A failure's
traceback names the body; the line printed before it says which arguments it had.
chain() puts several modules' bodies in one job; examples() runs example scripts, each as
`python examples/<script>` would, one after another in one job.

Callers hand run_mpi the function itself (``run`` or ``examples``). The bodies travel as
their module's name and their own names (the ranks' arguments are strings): args_for()
takes a module or its name, and functions or their names; framework tests give names, so
that pytest's process need not import their *_bodies.py (torch, TensorFlow)."""
import importlib


def run(module_name, *calls):
    """calls: "body" or "body:arg1,arg2" (string arguments, as run_mpi passes them); the
    call "--module" makes the next item the module of the calls after it (see chain)."""
    module = importlib.import_module(module_name)
    calls = iter(calls)
    for call in calls:
        if call == "--module":
            module_name = next(calls)
            module = importlib.import_module(module_name)
            continue
        name, _, args = call.partition(":")
        print(f"--- {module_name}.{name}({args})", flush=True)
        getattr(module, name)(*(args.split(",") if args else ()))


def chain(*arg_lists):
    """One job's args from several args_for() results (of different modules)."""
    out = list(arg_lists[0])
    for more in arg_lists[1:]:
        out += ["--module", *more]
    return tuple(out)


def args_for(module, bodies, arg_sets=None):
    """run_mpi's args: every body, or one body once per argument set. module: a module or
    its name; bodies: functions of it or their names ("body" or "body:arg1,arg2")."""
    module_name = module if isinstance(module, str) else module.__name__
    bodies = [body if isinstance(body, str) else _body_name(body, module_name)
              for body in bodies]
    if arg_sets is None:
        return (module_name, *bodies)
    (body,) = bodies
    return (module_name, *(f"{body}:{','.join(a)}" for a in arg_sets))


def _body_name(function, module_name):
    if function.__module__ != module_name or "." in function.__qualname__:
        raise ValueError("%r is not a top-level function of %s" % (function, module_name))
    return function.__name__


def example(script, *args):
    """A body that runs examples/<script> with args, as `python examples/<script> args`
    would, in this process (ringsync.testing.run_target does the same for one script); a
    non-zero exit status fails it."""
    import os
    import runpy
    import sys
    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", script)
    path = os.path.abspath(path)
    sys.argv = [path, *args]
    if os.path.dirname(path) not in sys.path:
        sys.path.insert(0, os.path.dirname(path))
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise AssertionError(f"examples/{script} {' '.join(args)} exited with {e.code}") \
                from e


def examples(*calls):
    """One body per example: calls are "script args..." strings (space-separated)."""
    for call in calls:
        script, *args = call.split(" ")
        print(f"--- example {call}", flush=True)
        example(script, *args)
