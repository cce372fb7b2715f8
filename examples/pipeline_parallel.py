"""Pipeline parallelism with ringsync's point-to-point messages (send / recv).

An MLP of 8 Linear+Tanh layers is cut into one stage per rank (4 ranks: 2 layers each).
Each batch is split into microbatches; stage s receives a microbatch's activations from
stage s-1, runs its layers and sends the result on to stage s+1; in backward the gradient
of those activations travels the other way. Two schedules:

  gpipe  every microbatch forward, then every microbatch backward (simple; keeps all
         microbatches' activations alive at once)
  1f1b   after a short warm-up each stage alternates one forward and one backward, so at
         most (stages - s) microbatches are in flight on stage s (less memory)

Run:
    mpirun -np 4 python examples/pipeline_parallel.py --schedule 1f1b --check

--check: every rank also trains the whole, unsplit model in one process on the same data;
the loss of every step (on the last stage) and the final parameters of each stage must
equal the pipeline's (float64, rtol 1e-10), else the job exits non-zero.
"""
import argparse
import copy
import sys

import torch

import ringsync.torch as hvd

LAYERS, WIDTH = 8, 16
RTOL = 1e-10


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true",
                        help="compare with the unsplit model trained in one process")
    return parser.parse_args()


def full_model(seed):
    """The whole model; the same on every rank (same seed), so each stage is a slice."""
    torch.manual_seed(seed)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers).double()


def my_stage(model, stage, stages):
    per = 2 * LAYERS // stages  # modules per stage (a Linear and a Tanh per layer)
    return copy.deepcopy(model[stage * per:(stage + 1) * per])


def batch(seed, step, size):
    """Inputs and targets of one step, the same on every rank (stage 0 uses the inputs,
    the last stage the targets)."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    x = torch.randn(size, WIDTH, generator=g, dtype=torch.float64)
    return x, torch.rand(size, WIDTH, generator=g, dtype=torch.float64) * 2 - 1


class Stage:
    """One rank's part of the pipeline: its layers and its two neighbours.

    Activations and gradients travel as plain tensors with explicit sends and recvs
    (backward is torch.autograd.backward(output, received_gradient)). Messages are named
    after the microbatch, so a mix-up would fail loudly instead of training silently."""

    def __init__(self, layers, stage, stages, micro):
        self.layers, self.stage, self.stages = layers, stage, stages
        self.first, self.last = stage == 0, stage == stages - 1
        self.shape = (micro, WIDTH)
        self.inputs = self.targets = None  # this step's microbatches (set per step)
        self.saved = {}  # microbatch -> (its input, its output or loss): kept for backward

    def _buffer(self):
        return torch.empty(self.shape, dtype=torch.float64)

    # Each exchange starts all its messages asynchronously, then waits for them: a send
    # completes only once the peer's recv is posted, so a stage that sends to and receives
    # from the same neighbour in one step must not do one after the other (both
    # neighbours would wait on each other's first message).
    def exchange(self, send_act=None, send_grad=None, recv_act=None, recv_grad=None):
        s, handles, received = self.stage, [], {}
        if send_act is not None and not self.last:
            i, t = send_act
            handles.append(hvd.send_async(t.detach(), s + 1, name=f"act{s}.{i}"))
        if send_grad is not None and not self.first:
            i, t = send_grad
            handles.append(hvd.send_async(t, s - 1, name=f"grad{s}.{i}"))
        if recv_act is not None and not self.first:
            received["act"] = self._buffer()
            handles.append(hvd.recv_async(received["act"], s - 1, name=f"act{s - 1}.{recv_act}"))
        if recv_grad is not None and not self.last:
            received["grad"] = self._buffer()
            handles.append(hvd.recv_async(received["grad"], s + 1,
                                          name=f"grad{s + 1}.{recv_grad}"))
        for h in handles:
            hvd.synchronize(h)
        return received.get("act"), received.get("grad")

    def forward(self, i, x):
        """Run microbatch i (x: its input as received; stage 0 reads the data)."""
        x = self.inputs[i] if self.first else x.requires_grad_()  # grad to send: x.grad
        out = self.layers(x)
        if self.last:  # the loss of the whole batch is the mean of the microbatches' losses
            out = torch.nn.functional.mse_loss(out, self.targets[i]) / len(self.targets)
        self.saved[i] = (x, out)
        return out

    def backward(self, i, grad):
        """Backward of microbatch i, given the gradient of its output; returns the
        gradient of its input (for the previous stage)."""
        x, out = self.saved.pop(i)
        torch.autograd.backward(out, None if self.last else grad)
        return x.grad


def gpipe(stage, n):
    """Every forward, then every backward. Only one message moves per call, towards a
    neighbour that is waiting for it: no stage ever waits on two at once."""
    outputs = {}
    for i in range(n):
        x, _ = stage.exchange(recv_act=i)
        outputs[i] = stage.forward(i, x)
        stage.exchange(send_act=(i, outputs[i]))
    for i in range(n):
        _, g = stage.exchange(recv_grad=i)
        stage.exchange(send_grad=(i, stage.backward(i, g)))
    return outputs


def one_f_one_b(stage, n):
    """Warm-up forwards (more on early stages, which the first gradients reach last),
    then one forward and one backward at a time, then the remaining backwards. In the
    steady state a stage sends an output to the next stage while it receives a gradient
    from it, and sends a gradient to the previous stage while it receives the next
    input from it (Megatron's send_forward_recv_backward / send_backward_recv_forward)."""
    outputs, warmup = {}, min(stage.stages - stage.stage - 1, n)
    for i in range(warmup):
        x, _ = stage.exchange(recv_act=i)
        outputs[i] = stage.forward(i, x)
        stage.exchange(send_act=(i, outputs[i]))
    x, _ = stage.exchange(recv_act=warmup) if warmup < n else (None, None)
    for k, i in enumerate(range(warmup, n)):  # i: forward microbatch, k: backward one
        outputs[i] = stage.forward(i, x)
        _, g = stage.exchange(send_act=(i, outputs[i]), recv_grad=k)
        grad_in = stage.backward(k, g)
        more = i + 1 < n
        x, _ = stage.exchange(send_grad=(k, grad_in), recv_act=i + 1 if more else None)
    for k in range(n - warmup, n):
        _, g = stage.exchange(recv_grad=k)
        stage.exchange(send_grad=(k, stage.backward(k, g)))
    return outputs


def train_pipeline(args, layers, stage_no, stages):
    micro = args.batch // args.microbatches
    stage = Stage(layers, stage_no, stages, micro)
    schedule = gpipe if args.schedule == "gpipe" else one_f_one_b
    opt = torch.optim.SGD(layers.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        x, y = batch(args.seed, step, args.batch)
        opt.zero_grad()
        stage.inputs, stage.targets = x.split(micro), y.split(micro)
        outputs = schedule(stage, args.microbatches)
        opt.step()  # every stage's gradients are complete: the last backward has run
        if stage.last:
            losses.append(sum(out.item() for out in outputs.values()))
            print(f"step {step}: loss {losses[-1]:.12f}", flush=True)
    return losses


def differences(args, stage_no, stages, losses, layers):
    """What differs from the unsplit model trained on the same batches, in this process
    (empty: nothing)."""
    reference = full_model(args.seed)
    opt = torch.optim.SGD(reference.parameters(), lr=args.lr)
    found = []
    for step in range(args.steps):
        x, y = batch(args.seed, step, args.batch)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(reference(x), y)
        loss.backward()
        opt.step()
        if losses and abs(losses[step] - loss.item()) > RTOL * abs(loss.item()):
            found.append(f"step {step} loss: pipeline {losses[step]!r}, unsplit {loss.item()!r}")
    mine = my_stage(reference, stage_no, stages)
    return found + parameter_differences("pipeline", stage_no, layers, mine)


def parameter_differences(what, stage_no, layers, reference):
    """A line per parameter of this stage that differs from the unsplit model's (to RTOL),
    with both values where they differ most."""
    found = []
    for (name, p), ref in zip(layers.named_parameters(), reference.parameters()):
        if not torch.allclose(p, ref, rtol=RTOL, atol=0):
            worst = (p - ref).abs().argmax()
            found.append(f"stage {stage_no} parameter {name}: {what} "
                         f"{p.flatten()[worst].item()!r}, unsplit {ref.flatten()[worst].item()!r}")
    return found


def main():
    args = parse_args()
    torch.set_num_threads(1)  # ranks share the host's cores
    hvd.init()
    stage_no, stages = hvd.rank(), hvd.size()
    if LAYERS % stages or args.batch % args.microbatches:
        sys.exit(f"need a rank count that divides {LAYERS} layers and a batch that "
                 f"divides into {args.microbatches} microbatches")
    layers = my_stage(full_model(args.seed), stage_no, stages)
    losses = train_pipeline(args, layers, stage_no, stages)
    failed = 0
    if args.check:
        found = differences(args, stage_no, stages, losses, layers)
        for line in found:
            print(f"rank {stage_no}: DIFFERS: {line}", file=sys.stderr, flush=True)
        # Every rank learns whether any rank failed, so all exit with the same status.
        failed = int(hvd.allreduce(torch.tensor([len(found)]), op=hvd.Sum, name="failed"))
        if stage_no == stages - 1 and not failed:
            print(f"check passed: {args.schedule} pipeline on {stages} stages equals the "
                  f"unsplit model", flush=True)
    hvd.shutdown()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
