"""Scale benchmarks: sibling modules, each with a ``*_table(work_dir, ...) -> list[dict]`` that
``benchmarks/bench_scale.py`` collects, and a ``main()`` that prints its table alone."""
