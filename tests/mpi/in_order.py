"""Run several rank bodies of one module one after another, in one mpirun job: one process
start and one framework import (seconds each for torch and TensorFlow) serve them all. Each
body starts and shuts ringsync down itself, as it does when it runs alone. A failure's
traceback names the body; the line printed before it says which arguments it had."""
import importlib

TARGET = "tests.mpi.in_order:run"


def run(module_name, *calls):
    """calls: "body" or "body:arg1,arg2" (string arguments, as run_mpi passes them)."""
    module = importlib.import_module(module_name)
    for call in calls:
        name, _, args = call.partition(":")
        print(f"--- {module_name}.{name}({args})", flush=True)
        getattr(module, name)(*(args.split(",") if args else ()))


def args_for(module_name, bodies, arg_sets=None):
    """run_mpi's args: every body, or one body once per argument set."""
    if arg_sets is None:
        return (module_name, *bodies)
    (body,) = bodies
    return (module_name, *(f"{body}:{','.join(a)}" for a in arg_sets))
