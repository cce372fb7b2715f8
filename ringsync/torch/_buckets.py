"""Gradients as views of reduction buffers (DistributedOptimizer(gradient_as_bucket_view=True)).

Each dtype's gradients live in one flat buffer, parameter after parameter, and p.grad is a
view of p's place in it: autograd accumulates straight into the buffer, and a reduction of
the buffer (or of a slice of it) leaves every gradient reduced, with nothing copied in or
out. Two users:
- StepBuffers (gradients reduced at step(), overlap off): one allreduce per dtype of the
  whole buffer (bind()).
- Buckets (gradients reduced during backward, overlap on): the buffer is cut into buckets
  of consecutive parameters, about BUCKET_BYTES each, and a bucket's allreduce (one
  request, prepared once) starts from the hook of its last gradient, as DDP's buckets do.
"""
import torch

from ._tensors import to_numpy

BUCKET_BYTES = 4 << 20  # a bucket's size: a few per step of a large model, one for a small


class BucketViews:
    """One flat buffer per dtype, and the gradients that are views of it."""

    def __init__(self):
        self.flat = {}  # dtype -> the buffer
        self.layout = {}  # dtype -> ids of its parameters, in buffer order

    def bind(self, dtype, params):
        """dtype's buffer with every gradient of params (in this order) a view of its place
        in it: gradients that are views already stay, the others are copied in and
        replaced by their view (a new layout, or a gradient the caller replaced)."""
        layout = tuple(id(p) for p in params)  # (ids: tensors compare elementwise)
        numel = sum(p.numel() for p in params)
        flat = self.flat.get(dtype)
        if self.layout.get(dtype) != layout or flat is None or flat.numel() != numel:
            self.layout[dtype] = layout
            flat = self.flat[dtype] = torch.zeros(numel, dtype=dtype)
        at = 0
        for p in params:
            n = p.numel()
            view = flat[at:at + n].view_as(p)
            grad = p.grad
            if grad is None or grad.data_ptr() != view.data_ptr() or \
                    grad.stride() != view.stride():
                if grad is not None:
                    view.copy_(grad)
                p.grad = view
            at += n
        return flat


class Bucket:
    """Consecutive parameters of one dtype whose gradients are one slice of its buffer."""

    __slots__ = ("name", "params", "slice", "prepared", "ready")

    def __init__(self, name, params, flat_slice):
        self.name, self.params, self.slice = name, params, flat_slice
        self.prepared = None  # a PreparedAllreduce of the slice, per communicator
        self.ready = set()  # (ids of) parameters whose gradient is complete this step

    def start(self, comm, op, scale):
        """Start the bucket's allreduce (in place, on the slice)."""
        if self.prepared is None or self.prepared.comm is not comm:
            self.prepared = comm.prepare_allreduce_(
                self.name, to_numpy(self.slice, "DistributedOptimizer"), op, **scale)
        self.ready.clear()
        return self.prepared.start(self.slice.data_ptr(), self.slice)


class Buckets:
    """The buckets of a DistributedOptimizer that reduces during backward: built at the
    first step() (from then on every gradient is a view), in reverse parameter order
    within each dtype (the order backward completes gradients in)."""

    def __init__(self, name: str):
        self._name = name
        self.views = BucketViews()
        self.of = {}  # parameter -> its Bucket (empty until built)
        self._view = {}  # parameter -> the view its gradient must be

    def build(self, params) -> None:
        """Bind every gradient of params (dense, on the CPU) as a view, and cut buckets
        where the layout is new (the same layout keeps its buckets and their requests)."""
        by_dtype = {}
        for p in params:
            by_dtype.setdefault(p.grad.dtype, []).append(p)
        same = set(self.views.layout) == set(by_dtype) and all(
            self.views.layout[d] == tuple(id(p) for p in g) for d, g in by_dtype.items())
        if not same:
            self.of = {}
        for dtype, group in by_dtype.items():
            flat = self.views.bind(dtype, group)
            if not same:
                self._cut(dtype, group, flat)
        self._view = {p: p.grad for p in params}

    def _cut(self, dtype, group, flat):
        offsets, at = [], 0
        for p in group:
            offsets.append(at)
            at += p.numel()
        tag = str(dtype).replace("torch.", "")
        end, members, index = at, [], 0
        for p, start in reversed(list(zip(group, offsets))):
            members.append(p)
            size = (end - start) * flat.element_size()
            if size >= BUCKET_BYTES or start == 0:
                bucket = Bucket(f"{self._name}.bucket.{tag}.{index}", members,
                                flat[start:end])
                for q in members:
                    self.of[q] = bucket
                end, members, index = start, [], index + 1

    def ready(self, p):
        """p's gradient is complete: its Bucket when that was the bucket's last, else None."""
        bucket = self.of[p]
        bucket.ready.add(id(p))
        return bucket if len(bucket.ready) == len(bucket.params) else None

    def reset(self) -> None:
        """Forget which gradients are ready (elastic recovery: the step starts over)."""
        for bucket in set(self.of.values()):
            bucket.ready.clear()

    def is_view(self, p) -> bool:
        """Whether p's gradient is still the view its bucket reduces (not a tensor the
        caller, or autograd after p.grad = None, put in its place)."""
        view, grad = self._view.get(p), p.grad
        return view is not None and grad is not None and \
            grad.data_ptr() == view.data_ptr() and grad.stride() == view.stride()
