from deadpool_cli.main import main

main()
