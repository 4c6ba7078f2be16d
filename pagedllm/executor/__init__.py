"""Executors: what stands between the engine core and its model runners, one rank or several
(``base``: the interface and one rank; ``multiproc``: a process per rank; ``ray_executor``: Ray
actors; ``worker_loop``: what a worker rank runs; ``factory``: the choice)."""
