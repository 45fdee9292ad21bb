from flare.scheduler.stats import Throughput


def test_throughput_keeps_only_recent_rounds_even_when_nobody_reads_it():
    # Without systemd or ctl nothing reads the rate; the window must not grow by a round forever.
    throughput = Throughput(window_s=0.0)
    for _ in range(1000):
        throughput.observe(32)
    assert throughput.rounds_held <= 1


def test_throughput_is_the_tokens_of_the_window_per_second():
    throughput = Throughput(window_s=3600.0)
    for _ in range(10):
        throughput.observe(36)
    assert throughput.rate == 360 / 3600
