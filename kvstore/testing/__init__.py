"""Real parts around the daemon for tests and benchmarks alike (both may import it, as neither
may import the other): a vLLM engine with the kvstore connector in its own process, and the stop
of any child process."""
