from k3.cli import main

raise SystemExit(main())
