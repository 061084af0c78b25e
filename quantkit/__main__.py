from quantkit.cli.app import main

main()
