import pytest


@pytest.fixture(scope="session")
def digits_task():
    from gradtrace.eval import DigitsTask

    return DigitsTask()


@pytest.fixture(scope="session")
def digits_ground_truth(digits_task):
    from gradtrace.eval import build_lds_ground_truth
    from gradtrace.options.eval import LDSOptions

    task = digits_task
    return build_lds_ground_truth(task.train, task.outcome, task.num_train, config=task.config,
                                  options=LDSOptions(num_subsets=24, seed=0))
