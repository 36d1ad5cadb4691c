"""runtime/planner/suggest.py: the TP / GPU that `kvserve plan` suggests for a plan that does not fit."""

from kvserve.runtime.planner import catalog, suggest

L70 = catalog.MODELS["llama-3-70b"]


def test_the_smallest_wider_tensor_parallel_size_that_fits_within_a_node():
    asked = []

    def fits(tp: int) -> bool:
        asked.append(tp)
        return tp >= 4

    assert suggest.wider_tensor_parallel_size(L70, 1, 8, fits) == 4
    assert asked == [2, 4]  # ascending, above the current size only
    assert suggest.wider_tensor_parallel_size(L70, 1, 2, fits) is None  # 4 is beyond the node
    assert suggest.wider_tensor_parallel_size(L70, 8, 8, lambda tp: True) is None


def test_the_gpu_with_the_least_memory_above_that_fits():
    l4 = catalog.GPUS["l4"]
    by_memory = sorted(
        (g.memory_mib, g.usd_per_gpu_hour, k) for k, g in catalog.GPUS.items() if g.memory_mib > l4.memory_mib
    )
    assert suggest.bigger_gpu(l4, lambda key: True) == by_memory[0][2]
    assert suggest.bigger_gpu(l4, lambda key: key == "h200-141gb") == "h200-141gb"
    largest = max(catalog.GPUS.values(), key=lambda g: g.memory_mib)
    assert suggest.bigger_gpu(largest, lambda key: True) is None  # nothing has more memory
    assert suggest.bigger_gpu(l4, lambda key: False) is None
