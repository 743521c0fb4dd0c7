"""The fork server: the process warm ranks are forked from (``server.py``).

Not a rank and not kernel code: ``warmstart.py`` (the kernel's client) starts
``server.py`` as a process of its own, which imports torch once and forks ranks
that then run ``rank/bootstrap.py`` as a cold rank would. Nothing imports this
package; it is started by its path.
"""
