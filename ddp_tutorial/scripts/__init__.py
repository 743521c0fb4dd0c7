"""Small worker scripts, one per lesson, each started by ``ddp_tutorial.launch`` as one process per rank."""
