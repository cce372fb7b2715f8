"""Code that test files in several directories share (none of it is a test itself):

reference.py          rank inputs and numpy references for every collective
collective_checks.py  collective checks on a `comm` (thread ranks or the module under mpirun)
mismatches.py         mismatched calls on some ranks, and the stress loop of them
in_order.py           many rank bodies (or example scripts) one after another in one mpirun job
"""
