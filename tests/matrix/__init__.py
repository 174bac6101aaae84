"""The combination matrix (issue 47 item 13): jobs drawn from the cross product of layouts, ZeRO
stages, precisions, recompute, a lost rank at some point and a resume under another layout, each
checked against its uninterrupted one-process reference.

``design`` is pure Python (the axes, the rules that exclude a combination, the pairwise-covering
set, the seeded random sample); ``rows`` runs one row as real ``mpiexec`` jobs and checks it;
``driver`` is the program those jobs run (``hpctrain train`` with a kill or a stop injected).
``tests/test_matrix.py`` runs the rows, ``tests/test_matrix_design.py`` tests the design.
"""
