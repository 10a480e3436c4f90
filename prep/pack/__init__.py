"""Stage `pack`: plan which samples share a fixed-size pack, from length columns only.

`core` holds the planner (counting sort + best-fit decreasing + Martello-Toth bound);
`baselines` holds the packers we compare against in tests and benchmarks.
"""
