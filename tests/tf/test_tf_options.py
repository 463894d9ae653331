"""One ``flashckpt.Options`` through the TF checkpointer, its Keras callback and the
estimator hook: every option reaches the engine (``allow_pickle`` and ``replicas``
included), keyword shorthands are laid over ``options=``, and a keyword that is no
option is a TypeError at construction."""

import fractions
import glob

import numpy as np
import pytest
import tensorflow as tf

from flashckpt import CheckpointError, Options
from flashckpt._names import job_prefix
from flashckpt.tf import Checkpointer, FlashCheckpointCallback, FlashCheckpointHook

from ._models import dense_model, same, values


def test_the_checkpointer_takes_an_options_object_and_shorthands_over_it(tmp_path, job_id):
    options = Options(persist_every=2, keep_last=1, job_id=job_id, allow_pickle=True, memory_slots=1, replicas=0)
    with Checkpointer(tmp_path, dense_model(), options=options) as ck:
        assert ck.engine.options == options and ck.job_id == job_id
    with Checkpointer(tmp_path, dense_model(), options=Options(keep_last=1), job_id=job_id, keep_last=4) as ck:
        assert ck.engine.options == Options(keep_last=4, job_id=job_id)


def test_replicas_reaches_the_engine(tmp_path, job_id):
    with Checkpointer(tmp_path, dense_model(), job_id=job_id, replicas=0) as ck:
        assert ck.engine.options.replicas == 0


def test_allow_pickle_round_trips_a_non_tensor_object(tmp_path, job_id):
    model = dense_model()
    saved = values(model)
    extra = {"ratio": fractions.Fraction(1, 3), "epoch": 2}
    with Checkpointer(tmp_path, model, job_id=job_id, allow_pickle=True) as ck:
        ck.save(3, extra=extra)
    other = dense_model(seed=1)
    with Checkpointer(tmp_path, other, job_id=job_id, allow_pickle=True) as ck:  # from storage
        assert ck.load() == 3 and ck.extra == extra
        assert same(values(other), saved)
    with Checkpointer(tmp_path, dense_model(seed=1), job_id=job_id) as ck:
        with pytest.raises(CheckpointError, match="allow_pickle"):
            ck.load()
    with Checkpointer(tmp_path / "strict", dense_model(), job_id=job_id + "s") as ck:
        with pytest.raises(CheckpointError, match="allow_pickle"):
            ck.save(1, extra=extra)
        ck.save(1, extra={"epoch": 2})  # plain values need no pickling
        assert ck.load() == 1 and ck.extra == {"epoch": 2}


def test_unknown_keywords_are_type_errors_at_construction(tmp_path):
    with pytest.raises(TypeError, match="keep_lst"):
        Checkpointer(tmp_path, dense_model(), keep_lst=2)
    with pytest.raises(TypeError, match="keep_lst"):
        FlashCheckpointCallback(tmp_path, keep_lst=2)
    with pytest.raises(TypeError, match="keep_lst"):
        FlashCheckpointHook(tmp_path, keep_lst=2)
    with pytest.raises(TypeError, match="flashckpt.Options"):
        FlashCheckpointHook(tmp_path, options={"keep_last": 2})


def test_the_keras_callback_hands_its_options_to_its_checkpointer(tmp_path, job_id):
    options = Options(job_id=job_id, memory_slots=1, keep_last=1)
    callback = FlashCheckpointCallback(tmp_path, every_steps=2, options=options, allow_pickle=True)
    model = dense_model(trained=False)
    try:
        model.fit(np.ones((16, 4)), np.ones((16, 1)), batch_size=4, verbose=0, callbacks=[callback])
        assert callback.checkpointer.engine.options == Options(job_id=job_id, memory_slots=1, keep_last=1,
                                                               allow_pickle=True)
    finally:
        callback.close()


def test_the_estimator_hook_runs_its_engine_with_its_options(tmp_path, job_id):
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.train.get_or_create_global_step()
        tf.compat.v1.get_variable("w", [3, 2], use_resource=True)
        hook = FlashCheckpointHook(tmp_path, every_steps=1 << 30, options=Options(job_id=job_id, memory_slots=1))
        hook.begin()
        try:
            with tf.compat.v1.Session(graph=graph) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                hook.after_create_session(sess, None)
                hook._save(sess, 1)
                hook._save(sess, 2)
                assert [p.rsplit(".", 1)[-1] for p in glob.glob(job_prefix(job_id) + ".rank0.slot*")] == ["slot0"]
        finally:
            hook.close()
