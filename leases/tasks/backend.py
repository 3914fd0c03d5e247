def configured_queues():
    return set()
