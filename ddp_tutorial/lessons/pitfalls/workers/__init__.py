"""Worker scripts of lesson 09 (one per pitfall, and the lab that runs six in one launch)."""
