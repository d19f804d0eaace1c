"""Personalised accuracy the two ways the literature reports it, against hand computations."""

import numpy as np
import pytest

from fedray.platform.runtime.evaluation import personalized_accuracy
from fedray.platform.tracking.names import Metrics


def test_plain_and_weighted_personal_means_by_hand():
    # Prepare: client 0 gets 9/10 right, client 1 gets 1/2, client 2 gets 30/40
    correct = np.array([9.0, 1.0, 30.0])
    total = np.array([10.0, 2.0, 40.0])
    loss = np.array([1.0, 2.0, 3.0])
    # Execute
    out = personalized_accuracy(correct, total, loss)
    # Assert: plain mean (0.9 + 0.5 + 0.75) / 3 = 0.716666...; weighted 40 / 52 = 0.769230...
    assert out[Metrics.ACC_PERSONAL_MEAN] == pytest.approx(2.15 / 3)
    assert out[Metrics.ACC_PERSONAL_WEIGHTED] == pytest.approx(40 / 52)
    # population std of (0.9, 0.5, 0.75) around 0.71667: sqrt((0.0336 + 0.0469 + 0.0011) / 3)
    assert out[Metrics.ACC_PERSONAL_STD] == pytest.approx(np.std([0.9, 0.5, 0.75]))
    assert out[Metrics.LOSS_PERSONAL] == pytest.approx(6 / 52)


def test_clients_without_test_data_are_left_out():
    out = personalized_accuracy(np.array([3.0, 0.0]), np.array([4.0, 0.0]), np.array([0.0, 0.0]))
    assert out[Metrics.ACC_PERSONAL_MEAN] == 0.75 and out[Metrics.ACC_PERSONAL_WEIGHTED] == 0.75
    assert personalized_accuracy(np.zeros(2), np.zeros(2), np.zeros(2)) == {}
