"""Data-parallel softmax regression on scikit-learn's bundled digits, in plain numpy.

Each rank trains on its own shard of the training set; gradients are averaged with
ringsync.allreduce, so every rank takes the same step. Run on 2 ranks with:

    ringsync run -np 2 examples/numpy_digits.py
"""
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import ringsync as rs


def softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def gradients(w, b, x, y_onehot):
    p = softmax(x @ w + b)
    diff = (p - y_onehot) / len(x)
    return x.T @ diff, diff.sum(axis=0)


def main(epochs=60, batch=32, lr=0.5):
    rs.init()
    digits = load_digits()
    x = digits.data / 16.0
    x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=0.25,
                                                        random_state=0)
    shard = slice(rs.rank(), None, rs.size())  # this rank's part of the training set
    x_mine, y_mine = x_train[shard], np.eye(10)[y_train[shard]]

    rng = np.random.default_rng(rs.rank())  # ranks start different ...
    w = rng.normal(0, 0.01, (64, 10))
    b = np.zeros(10)
    rs.broadcast_(w, root_rank=0)  # ... and rank 0's start wins
    steps = len(x_mine) // batch
    for epoch in range(epochs):
        order = np.random.default_rng(epoch * 1000 + rs.rank()).permutation(len(x_mine))
        for step in range(steps):
            idx = order[step * batch:(step + 1) * batch]
            gw, gb = gradients(w, b, x_mine[idx], y_mine[idx])
            w -= lr * rs.allreduce(gw, op=rs.Average, name="grad.w")
            b -= lr * rs.allreduce(gb, op=rs.Average, name="grad.b")
        if rs.rank() == 0 and (epoch + 1) % 20 == 0:
            print(f"epoch {epoch + 1}: train loss "
                  f"{-np.mean(np.log(softmax(x_train @ w + b)[np.arange(len(x_train)), y_train])):.4f}",
                  flush=True)
    # Every rank scores its share of the test set; the counts are summed over all ranks.
    test_shard = slice(rs.rank(), None, rs.size())
    correct = np.sum(np.argmax(x_test[test_shard] @ w + b, axis=1) == y_test[test_shard])
    totals = rs.allreduce(np.array([correct, len(y_test[test_shard])], dtype=np.int64), op=rs.Sum)
    if rs.rank() == 0:
        print(f"test accuracy on {rs.size()} ranks: {totals[0] / totals[1]:.4f}")
    rs.shutdown()


if __name__ == "__main__":
    main()
