"""Small Keras models and an estimator model_fn for the in-process tests."""

import numpy as np
import tensorflow as tf


def dense_model(width=3, *, trained=True, seed=0):
    """Input(4) -> Dense(width) -> Dense(1), compiled with Adam; one fit step when trained."""
    tf.keras.utils.set_random_seed(seed)
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(width), tf.keras.layers.Dense(1)])
    model.compile(tf.keras.optimizers.Adam(0.01), "mse")
    if trained:
        model.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0)
    return model


def values(model):
    return [v.numpy().copy() for v in model.variables + model.optimizer.variables]


def same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def linear_model_fn(features, labels, mode):
    """An estimator model_fn: ``labels ~ features["x"] @ w``, one SGD step per batch."""
    w = tf.compat.v1.get_variable("w", [1, 1])
    loss = tf.reduce_mean((tf.matmul(features["x"], w)[:, 0] - labels) ** 2)
    train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
        loss, global_step=tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)
